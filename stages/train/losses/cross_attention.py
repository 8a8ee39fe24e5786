"""Cross-attention KL for encoder-decoder students: decoder queries attending over encoder keys (shapes below).

The definition is DESIGN's attention KL with rectangular maps: the mean over student heads and valid query rows of
KL(A_t row ‖ A_s row), restricted to valid keys.
"""

from __future__ import annotations

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.attention.maps_loss import STUDENT_PROB_FLOOR, group_teacher_heads
from kdcache.stages.targets.logits.vocab.loss_rows import count_valid, kl_terms


def cross_attention_kl(a_s: torch.Tensor, a_t: torch.Tensor, query_mask: torch.Tensor,
                       key_mask: torch.Tensor) -> torch.Tensor:
    """Σ KL(A_t row ‖ A_s row) / (H_s · N_q) over valid decoder queries, each row renormalised on valid keys.

    Args:
        a_s: ``[B, H_s, L_dec, L_enc]`` student cross-attention probabilities.
        a_t: ``[B, H_t, L_dec, L_enc]`` teacher's, H_t a multiple of H_s (teacher heads averaged in groups).
        query_mask: ``[B, L_dec]``, 1 for a real decoder token.
        key_mask: ``[B, L_enc]``, 1 for a real encoder token.
    """
    if a_s.dim() != 4 or a_t.shape[0] != a_s.shape[0] or a_t.shape[2:] != a_s.shape[2:] \
            or tuple(query_mask.shape) != tuple(a_s.shape[::2]) or key_mask.shape != (a_s.shape[0], a_s.shape[3]):
        raise LossError(f"cross-attention shapes do not line up: student {tuple(a_s.shape)}, teacher "
                        f"{tuple(a_t.shape)}, masks {tuple(query_mask.shape)} and {tuple(key_mask.shape)} "
                        "(expected [B, H, L_dec, L_enc] twice, [B, L_dec] and [B, L_enc])")
    q, k = query_mask.bool(), key_mask.bool()
    n_valid = count_valid(q)
    pair_valid = (q[:, :, None] & k[:, None, :])[:, None]  # [B, 1, L_dec, L_enc]
    p_t = _renormalise(group_teacher_heads(a_t, a_s.shape[1]).float(), pair_valid)
    p_s = _renormalise(a_s.float(), pair_valid)
    log_t = torch.log(torch.where(p_t > 0, p_t, torch.zeros_like(p_t)))
    log_s = torch.log(p_s.clamp_min(STUDENT_PROB_FLOOR))
    return kl_terms(log_t, log_s).sum() / (a_s.shape[1] * n_valid)


def _renormalise(a: torch.Tensor, pair_valid: torch.Tensor) -> torch.Tensor:
    """Keep (valid query, valid key) entries by selection (NaN-safe), then make each row sum to 1."""
    kept = torch.where(pair_valid, a, torch.zeros_like(a))
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(1e-12)
