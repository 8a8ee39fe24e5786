"""Attention losses from queries and keys, a block of query rows at a time: neither side's ``[B, H, L, L]`` exists.

``blocked_attention_kl`` is DESIGN's attention KL (``maps_loss.attention_kl``: the mean over student heads
and counted query rows of KL(teacher row ‖ student row) over the valid keys, teacher heads averaged in contiguous
groups of H_t / H_s), computed from each side's queries and keys and score rule
(``qk_attention``). Each block of ``QUERY_BLOCK`` query rows runs under activation checkpointing, so
the forward keeps only a scalar per block and the backward recomputes one block's ``[B, H, C, L]`` at a time:
memory grows linearly in L. Value and gradient are those of the full computation (tested).

``relation_kl`` is MiniLMv2's self-attention relation loss: a side's per-token vectors (queries, keys or values,
all heads concatenated, ``[B, L, W]``) are split into R relation heads and their scaled dot products with each
other, softmaxed over the keys each token attends, are compared by the same blocked KL. Student and teacher may
have different widths and head counts; only R is shared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from kdcache.stages.common.documents import document_index
from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.attention.maps_loss import STUDENT_PROB_FLOOR
from kdcache.stages.targets.attention.qk_attention import Captured, ScoreRule, allowed_keys, block_log_probs
from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, count_valid

QUERY_BLOCK = 128  # query rows per block: a [B, H, 128, L] fp32 block at a time
LOG_FLOOR = math.log(STUDENT_PROB_FLOOR)  # log(max(p, floor)) == max(log p, log floor): the maps path's floor


def heads_from_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Cached token rows ``[B, L, heads * d]`` (head-major) -> ``[B, heads, L, d]``."""
    b, length, width = rows.shape
    if width % heads:
        raise LossError(f"cached attention rows of width {width} do not split into {heads} heads")
    return rows.reshape(b, length, heads, width // heads).transpose(1, 2)


def blocked_attention_kl(student: Captured, teacher: Captured, mask: torch.Tensor,
                         queries: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                         block: int = QUERY_BLOCK) -> torch.Tensor:
    """Mean over student heads and counted query rows of KL(A_t row ‖ A_s row), A rebuilt from q and k.

    Args:
        student, teacher: the two sides; the teacher's head count must be a multiple of the student's.
        mask: ``[B, L]`` real tokens (the valid keys).
        queries: ``[B, L]`` the query rows counted (trained tokens); default ``mask``.
        position_ids: ``[B, L]`` of rows packed with documents kept apart (attention stays in each), or None.
        block: query rows per block.

    Returns:
        Scalar: Σ KL / (H_s · N_v), as ``attention_kl`` on the full maps.
    """
    s_heads, t_heads = student.q.shape[1], teacher.q.shape[1]
    if t_heads % s_heads:
        raise LossError(f"attention KL cannot pair {t_heads} teacher heads with {s_heads} student heads: the "
                        f"teacher's head count must be a multiple of the student's (heads are averaged in groups)")
    real = bool_mask(mask, student.q[:, 0])
    counted = real if queries is None else real & bool_mask(queries, student.q[:, 0], "queries")
    n_valid = count_valid(counted)
    documents = None if position_ids is None else document_index(position_ids)
    total = student.q.new_zeros((), dtype=torch.float32)
    for start in range(0, real.shape[1], block):
        rows = slice(start, min(start + block, real.shape[1]))
        total = total + checkpoint(_block_kl, student.q[:, :, rows], student.k, teacher.q[:, :, rows], teacher.k,
                                   real, counted[:, rows], documents, rows, student.rule, teacher.rule,
                                   use_reentrant=False)
    return total / (s_heads * n_valid)


def _block_kl(s_q: torch.Tensor, s_k: torch.Tensor, t_q: torch.Tensor, t_k: torch.Tensor, real: torch.Tensor,
              counted: torch.Tensor, documents: torch.Tensor | None, rows: slice, s_rule: ScoreRule,
              t_rule: ScoreRule) -> torch.Tensor:
    """Σ KL over one block's counted query rows and the student's heads (``[B, H, C, L]`` lives only here).

    KL = Σ p_t log p_t - Σ p_t log p_s: the teacher's part carries no gradient, so it is computed without a graph
    (half the saved tensors); ``xlogy`` gives 0 · log 0 = 0, and the student's floor keeps its log finite.
    """
    allowed = allowed_keys(real, rows, s_rule, documents)
    log_s = block_log_probs(s_q, s_k, s_rule, allowed)
    b, s_heads, c, length = log_s.shape
    with torch.no_grad():
        same_keys = (s_rule.causal, s_rule.sliding_window) == (t_rule.causal, t_rule.sliding_window)
        p_t = block_log_probs(t_q, t_k, t_rule, allowed if same_keys else allowed_keys(real, rows, t_rule,
                                                                                       documents)).exp()
        p_t = p_t.reshape(b, s_heads, -1, c, length).mean(dim=2)  # contiguous groups of H_t / H_s teacher heads
        teacher_part = torch.xlogy(p_t, p_t).sum(dim=(1, 3))  # [B, C]
    per_row = teacher_part - (p_t * log_s.clamp_min(LOG_FLOOR)).sum(dim=(1, 3))
    return torch.where(counted, per_row, torch.zeros_like(per_row)).sum()


def relation_side(vectors: torch.Tensor, relation_heads: int, causal: bool) -> Captured:
    """``[B, L, W]`` vectors as a side whose "attention" is their relation: R heads of width W / R, scaled by
    ``(W / R) ** -0.5``, each token relating to the keys it attends (causal for causal models)."""
    b, length, width = vectors.shape
    if relation_heads < 1 or width % relation_heads:
        raise LossError(f"the relation loss splits vectors of width {width} into {relation_heads} relation heads; "
                        f"choose --relation-heads dividing both sides' widths")
    x = heads_from_rows(vectors, relation_heads)
    return Captured(x, x, ScoreRule((width // relation_heads) ** -0.5, causal))


def relation_kl(x_s: torch.Tensor, x_t: torch.Tensor, mask: torch.Tensor, relation_heads: int, *, causal: bool,
                queries: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """MiniLMv2 relation KL between student vectors ``x_s [B, L, W_s]`` and teacher vectors ``x_t [B, L, W_t]``.

    The mean over relation heads and counted query rows of KL(R_t row ‖ R_s row), where
    ``R = softmax(x_r · x_rᵀ / sqrt(W / R))`` per relation head r, over the keys a token attends.
    """
    return blocked_attention_kl(relation_side(x_s, relation_heads, causal), relation_side(x_t, relation_heads, causal),
                                mask, queries, position_ids)


def cached_qk_loss(loss: str, student: Captured, targets: Mapping[str, torch.Tensor], block: int,
                   scores: Mapping[str, Any], mask: torch.Tensor, queries: torch.Tensor,
                   relation_heads: int = 0) -> torch.Tensor:
    """The attention term of one (student block, teacher block) pair read from a q/k cache.

    Args:
        loss: ``"kl"`` (``blocked_attention_kl``) or ``"relation"`` (``relation_kl`` summed over the cached kinds:
            queries, keys, and values when cached, as MiniLMv2 sums its q-q, k-k and v-v terms).
        student: the student block's recorded ``q [B, H_s, L, d_s]``, ``k``/``v [B, H_s_kv, L, d_s]`` and rule.
        targets: the batch: ``attention_q/{block} [B, L, H * d]``, ``attention_k/{block}`` (and ``_v``)
            ``[B, L, H_kv * d]``, and ``position_ids`` for rows packed with documents kept apart.
        block: the teacher block.
        scores: the cache's ``attention_scores`` (head counts, causality, each block's rule).
        mask, queries: ``[B, L]`` real tokens and the counted query rows.
        relation_heads: R for the relation loss (0: the student's query heads).
    """
    rule = ScoreRule.from_json(scores["blocks"][str(block)], scores["causal"])
    positions = targets.get("position_ids")
    if loss == "kl":
        teacher = Captured(heads_from_rows(targets[f"attention_q/{block}"], int(scores["num_heads"])),
                            heads_from_rows(targets[f"attention_k/{block}"], int(scores["num_kv_heads"])), rule)
        return blocked_attention_kl(student, teacher, mask, queries, positions)
    heads = relation_heads or student.q.shape[1]
    total = student.q.new_zeros((), dtype=torch.float32)
    for kind in ("q", "k", "v"):
        name = f"attention_{kind}/{block}"
        if name in targets:
            rows = getattr(student, kind).transpose(1, 2).flatten(2)  # [B, H, L, d] -> [B, L, H * d], as cached
            total = total + relation_kl(rows, targets[name], mask, heads,
                                        causal=rule.causal, queries=queries, position_ids=positions)
    return total
