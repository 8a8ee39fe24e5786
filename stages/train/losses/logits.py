"""Output-layer losses: the cross-entropies, causal and per token. The KLs against cached teacher logits belong to
their logit kinds' torch halves (``stages.targets.logits``); the loss registry names them from there.

Shapes: ``B`` batch, ``L`` sequence length, ``V`` vocabulary, ``N_v`` valid tokens.
Every function selects the valid rows first and upcasts only those to float32, so padded rows never reach
a softmax (garbage there cannot leak in) and the float32 copy is ``[N_v, V]``, not ``[B, L, V]``.
Each loss is defined once, as its term of a vocabulary pass (``*_term``); the loss is that term's scalar value.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kdcache.stages.targets.logits.vocab import vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits, fused_ce_available, fused_ce_sum
from kdcache.stages.targets.logits.vocab.kernel_feeds import ce_feed
from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, valid_count
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm

__all__ = ["causal_ce", "causal_ce_term", "token_ce", "token_ce_term"]


def causal_ce_term(logits: torch.Tensor | HeadLogits, input_ids: torch.Tensor, mask: torch.Tensor,
                   pairs: torch.Tensor | None = None) -> ChunkTerm:
    """Next-token cross-entropy with the HF causal shift: the logits at position t predict the token at t+1, as a
    term of a vocabulary pass (``vocab_pass``; ``causal_ce`` is its scalar value): rows ``[B, L]`` whose next
    token counts.

    A pair (t, t+1) counts only when both positions are real tokens. With right padding this is exactly HF's
    ``labels = -100 at padding``; with left padding it also drops the prediction made *from* a pad position,
    whose logits are garbage and must not count.

    Args:
        logits: ``[B, L, V]`` student logits, or the ``HeadLogits`` behind them (built chunk by chunk).
        input_ids: ``[B, L]`` token ids (any numeric dtype; float32 from the cache is fine).
        mask: ``[B, L]``.
        pairs: ``[B, L-1]``, the pairs (t, t+1) to count, when a loss mask or document boundaries leave some
            out (``masks.token_masks``); default every pair of real tokens.

    Its value is the mean over the valid (t, t+1) pairs (0, tied to the graph, when there are none).
    """
    m = bool_mask(mask, logits)
    pair_valid = m[:, :-1] & m[:, 1:] if pairs is None else pairs.bool()  # masks.pairs holds real pairs only
    predicting = torch.zeros_like(m)
    predicting[:, :-1] = pair_valid  # the positions whose logits predict a counted next token
    labels = torch.zeros(m.shape, dtype=torch.long, device=m.device)
    # 0 where no pair counts: a real row of another term's may sit there, and its label must be a valid id.
    labels[:, :-1] = torch.where(pair_valid, input_ids[:, 1:], torch.zeros_like(input_ids[:, 1:])).long()
    return _ce_term(logits, predicting, labels, valid_count(pair_valid))


def token_ce_term(logits: torch.Tensor | HeadLogits, labels: torch.Tensor, mask: torch.Tensor) -> ChunkTerm:
    """Unshifted cross-entropy (masked-LM / encoder heads): position t predicts ``labels[t]``, as a term of a
    vocabulary pass (``token_ce`` is its scalar value).

    Positions with ``mask == 0`` or ``labels == -100`` are ignored.

    Args:
        logits: ``[B, L, V]``, or the ``HeadLogits`` behind them.
        labels: ``[B, L]`` target ids, ``-100`` to ignore.
        mask: ``[B, L]``.

    Its value is the mean over the counted positions (0, tied to the graph, when there are none).
    """
    keep = bool_mask(mask, logits) & (labels != -100)
    safe = torch.where(keep, labels, torch.zeros_like(labels)).long()
    return _ce_term(logits, keep, safe, valid_count(keep))


causal_ce = vocab_pass.as_loss(causal_ce_term, "causal_ce")
token_ce = vocab_pass.as_loss(token_ce_term, "token_ce")


def _ce_term(logits: torch.Tensor | HeadLogits, rows: torch.Tensor, labels: torch.Tensor,
             n_valid: torch.Tensor) -> ChunkTerm:
    """CE over ``rows [B, L]`` against ``labels [B, L]`` (valid ids everywhere), mean over ``n_valid``; alone on a
    GPU with liger-kernel, its fused linear cross-entropy."""
    alone = None
    if isinstance(logits, HeadLogits) and fused_ce_available(logits.device):
        def alone() -> torch.Tensor:
            return fused_ce_sum(logits.select(rows), labels[rows]) / n_valid
    per_row = functools.partial(F.cross_entropy, reduction="none")  # [C] of [C, V] float32 logits, [C] labels
    return ChunkTerm(per_row, rows, (labels,), 1.0 / n_valid, alone, ce_feed())

