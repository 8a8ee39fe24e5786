"""Attention-map KL: the student's attention rows against the teacher's, over valid queries and keys.

Shapes: ``A_s [B, H_s, L, L]`` and ``A_t [B, H_t, L, L]`` are attention probabilities (rows = queries,
columns = keys), ``mask [B, L]``.
"""

from __future__ import annotations

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, count_valid, kl_terms

# Floor on the student's probabilities before the log: a softmax that underflows to exactly 0 where the teacher
# has mass would otherwise give an infinite loss and gradient; log(1e-12) ≈ -27.6 bounds that term instead.
STUDENT_PROB_FLOOR = 1e-12
# Guards the renormalising division for rows with no mass at all (never a valid query row in practice).
ROW_SUM_EPS = 1e-12


def group_teacher_heads(a_t: torch.Tensor, student_heads: int) -> torch.Tensor:
    """Average the teacher's heads in contiguous groups of ``H_t / H_s``: ``[B, H_t, L, L] -> [B, H_s, L, L]``.

    Student head i is matched with the mean of teacher heads ``[i·g, (i+1)·g)``, g = H_t / H_s.
    Raises ``LossError`` naming both counts when H_s does not divide H_t.
    """
    teacher_heads = a_t.shape[1]
    if student_heads <= 0 or teacher_heads % student_heads != 0:
        raise LossError(
            f"attention KL cannot pair {teacher_heads} teacher heads with {student_heads} student heads: "
            "the teacher's head count must be a multiple of the student's (heads are averaged in contiguous "
            "groups); cache a head subset that divides, or set the attention weight to 0"
        )
    if teacher_heads == student_heads:
        return a_t
    b, _, q, k = a_t.shape
    return a_t.reshape(b, student_heads, teacher_heads // student_heads, q, k).mean(dim=2)


def attention_kl(a_s: torch.Tensor, a_t: torch.Tensor, mask: torch.Tensor,
                 queries: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over student heads and valid query rows of KL(A_t row ‖ A_s row), restricted to valid keys.

    "Restricted to valid keys" is implemented as: keep only the (valid query, valid key) entries, then
    renormalise each row of both maps over the valid keys. For models that mask padded keys (every HF model)
    the rows already sum to 1 there and this changes nothing but rounding (a fp16-cached teacher row then
    compares exactly equal to itself); for anything else it keeps the loss a true KL between distributions
    over the same support. Teacher zeros (the causal triangle) count as 0 · log 0 = 0.

    Args:
        a_s: ``[B, H_s, L, L]`` student attention probabilities.
        a_t: ``[B, H_t, L, L]`` teacher attention probabilities, H_t a multiple of H_s.
        mask: ``[B, L]``, the valid keys (and queries, unless ``queries`` is given).
        queries: ``[B, L]``, the query rows counted (a loss mask's trained tokens); default ``mask``.

    Returns:
        Scalar: Σ KL / (H_s · N_v), N_v the counted query rows.
    """
    _check_shapes(a_s, a_t, mask)
    m = bool_mask(mask, a_s[:, 0])
    q = m if queries is None else m & bool_mask(queries, a_s[:, 0], "queries")
    n_valid = count_valid(q)
    pair_valid = (q[:, :, None] & m[:, None, :])[:, None]  # [B, 1, L(q), L(k)]
    p_t = _restrict_and_renormalise(group_teacher_heads(a_t, a_s.shape[1]).float(), pair_valid)
    p_s = _restrict_and_renormalise(a_s.float(), pair_valid)
    log_t = torch.log(torch.where(p_t > 0, p_t, torch.zeros_like(p_t)))  # -inf where the teacher has no mass
    log_s = torch.log(p_s.clamp_min(STUDENT_PROB_FLOOR))
    return kl_terms(log_t, log_s).sum() / (a_s.shape[1] * n_valid)


def _restrict_and_renormalise(a: torch.Tensor, pair_valid: torch.Tensor) -> torch.Tensor:
    """Zero every entry outside (valid query, valid key) by selection, then make valid rows sum to 1.

    ``torch.where`` (not a multiplication) so that inf/NaN at padded positions neither reach the value nor
    send NaN back through the gradient. Padded query rows become all zeros and contribute nothing.
    """
    kept = torch.where(pair_valid, a, torch.zeros_like(a))
    return kept / kept.sum(dim=-1, keepdim=True).clamp_min(ROW_SUM_EPS)


def _check_shapes(a_s: torch.Tensor, a_t: torch.Tensor, mask: torch.Tensor) -> None:
    if a_s.dim() != 4 or a_t.dim() != 4:
        raise LossError(f"attention maps must be [B, H, L, L], got {tuple(a_s.shape)} and {tuple(a_t.shape)}")
    b, _, q, k = a_s.shape
    if a_t.shape[0] != b or a_t.shape[2:] != a_s.shape[2:] or q != k or tuple(mask.shape) != (b, q):
        raise LossError(
            f"attention shapes do not line up: student {tuple(a_s.shape)}, teacher {tuple(a_t.shape)}, "
            f"mask {tuple(mask.shape)} (expected [B, H, L, L] twice and [B, L])"
        )
