"""Output-layer losses: cross-entropy, the KD KL on full logits, and the top-k KL in its two variants.

Shapes: ``B`` batch, ``L`` sequence length, ``V`` vocabulary, ``k`` cached top-k, ``N_v`` valid tokens.
Every function selects the valid rows first and upcasts only those to float32, so padded rows never reach
a softmax (garbage there cannot leak in) and the float32 copy is ``[N_v, V]``, not ``[B, L, V]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from kdcache.stages.train.losses._common import bool_mask, chunked_sum, count_valid, kl_terms, valid_rows
from kdcache.stages.train.losses.errors import LossError
from kdcache.stages.train.options import TOPK_KL_VARIANTS as TOPK_VARIANTS


def causal_ce(logits: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
              pairs: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross-entropy with the HF causal shift: the logits at position t predict the token at t+1.

    A pair (t, t+1) counts only when both positions are real tokens. With right padding this is exactly HF's
    ``labels = -100 at padding``; with left padding it also drops the prediction made *from* a pad position,
    whose logits are garbage and must not count.

    Args:
        logits: ``[B, L, V]`` student logits.
        input_ids: ``[B, L]`` token ids (any numeric dtype; float32 from the cache is fine).
        mask: ``[B, L]``.
        pairs: ``[B, L-1]``, the pairs (t, t+1) to count, when a loss mask or document boundaries leave some
            out (``masks.token_masks``); default every pair of real tokens.

    Returns:
        Scalar mean over the valid (t, t+1) pairs (0 when there are none).
    """
    m = bool_mask(mask, logits)
    pair_valid = m[:, :-1] & m[:, 1:] if pairs is None else pairs.bool()  # masks.pairs holds real pairs only
    rows = logits[:, :-1][pair_valid]
    labels = input_ids[:, 1:][pair_valid].long()
    if rows.shape[0] == 0:
        # Every sequence is one token long: nothing to predict. A zero still tied to the graph keeps
        # backward() working; the empty sum reads no logits, so it cannot be NaN.
        return rows.float().sum()
    return chunked_sum(_ce_sum, rows, labels) / rows.shape[0]


def token_ce(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unshifted cross-entropy (masked-LM / encoder heads): position t predicts ``labels[t]``.

    Positions with ``mask == 0`` or ``labels == -100`` are ignored.

    Args:
        logits: ``[B, L, V]``.
        labels: ``[B, L]`` target ids, ``-100`` to ignore.
        mask: ``[B, L]``.

    Returns:
        Scalar mean over the counted positions.
    """
    keep = bool_mask(mask, logits)
    keep = keep & (labels != -100)
    return chunked_sum(_ce_sum, logits[keep], labels[keep].long()) / count_valid(keep)


def _ce_sum(rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of ``[C, V]`` logits against ``[C]`` labels, in fp32."""
    return F.cross_entropy(rows.float(), labels, reduction="sum")


def kd_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """T² · mean over valid tokens of KL(softmax(z_t/T) ‖ softmax(z_s/T)): ``batchmean`` over ``[N_v, V]``.

    Args:
        student_logits: ``[B, L, V]``.
        teacher_logits: ``[B, L, V]`` (the cache's ``logits/full``).
        mask: ``[B, L]``.
        temperature: T > 0.

    Returns:
        Scalar.
    """
    _check_temperature(temperature)
    if student_logits.shape != teacher_logits.shape:
        raise LossError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ; the student and the cache must share one vocabulary"
        )
    n_valid = count_valid(bool_mask(mask, student_logits))
    return _kl_rows(valid_rows(student_logits, mask), valid_rows(teacher_logits, mask), n_valid, temperature)


def head_kl(
    student_logits: torch.Tensor, hidden_t: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
    mask: torch.Tensor, temperature: float = 1.0,
) -> torch.Tensor:
    """``kd_kl`` with the teacher's logits rebuilt from its cached last hidden layer through its LM head (caches
    written with ``--logits head``), for the valid tokens only: no ``[B, L, V]`` teacher tensor exists.

    Args:
        student_logits: ``[B, L, V]``.
        hidden_t: ``[B, L, d]`` the teacher's last hidden layer (after its final norm).
        head: maps ``[N_v, d]`` to ``[N_v, V]`` float32 logits (``stages.train.teacher_head.TeacherHead``).
        mask: ``[B, L]``.
        temperature: T > 0; exact at any T, since the full distribution is rebuilt.
    """
    _check_temperature(temperature)
    n_valid = count_valid(bool_mask(mask, student_logits))
    return _kl_rows(valid_rows(student_logits, mask), valid_rows(hidden_t, mask), n_valid, temperature, head)


def sampled_kl(
    student_logits: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, logp: torch.Tensor,
    mask: torch.Tensor, temperature: float = 1.0,
) -> torch.Tensor:
    """KD KL estimated from draws of the teacher's distribution (caches written with ``--logits sampled:N``).

    Random-sampling KD (Anshumann et al., ACL 2025, arXiv 2503.16870): with N draws x_1..x_N from the teacher's
    p_T = softmax(z_t / T) per token, kept as distinct ids i with counts c_i and the teacher's log p_T(i),

        KL(p_T ‖ s_T) ≈ (1/N) Σ_n [log p_T(x_n) − log s_T(x_n)] = Σ_i (c_i / N) · (log p_T(i) − log s_T(i)),

    with s_T = softmax(z_s / T). Its expectation over the draws is the KL exactly, so its gradient is the full KD
    gradient in expectation, where a top-k KL is biased. Scaled by T² like ``kd_kl``; T must be the temperature
    the cache drew at.

    Args:
        student_logits: ``[B, L, V]``.
        ids, counts, logp: ``[B, L, N]`` the cached ``logits/sample_*`` arrays (count 0 marks an unused slot).
        mask: ``[B, L]``.
        temperature: T, the cache's ``sample_temperature``.

    Returns:
        Scalar: T² · mean over valid tokens of the estimate.
    """
    _check_temperature(temperature)
    n_valid = count_valid(bool_mask(mask, student_logits))

    def chunk_estimate(z: torch.Tensor, drawn: torch.Tensor, count: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
        log_s = F.log_softmax(z.float() / temperature, dim=-1).gather(1, drawn.long())
        weights = count.float() / count.float().sum(-1, keepdim=True).clamp_min(1.0)
        return (weights * (log_p.float() - log_s)).sum()
    rows = (valid_rows(t, mask) for t in (student_logits, ids, counts, logp))
    return chunked_sum(chunk_estimate, *rows) / n_valid * temperature**2


def _kl_rows(z_s: torch.Tensor, teacher_rows: torch.Tensor, n_valid: int, temperature: float,
             to_logits: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """T² · Σ KL(softmax(z_t/T) ‖ softmax(z_s/T)) / n_valid over valid rows, in chunks (``chunked_sum``); a head
    cache's teacher logits ``to_logits(teacher_rows)`` are rebuilt chunk by chunk too."""

    def chunk_kl(z: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        z_t = rows if to_logits is None else to_logits(rows)
        if z.shape != z_t.shape:
            raise LossError(f"student logits {tuple(z.shape)} and teacher logits {tuple(z_t.shape)} differ on the "
                            f"valid tokens; the student and the cache must share one vocabulary")
        return kl_terms(F.log_softmax(z_t.float() / temperature, -1), F.log_softmax(z.float() / temperature, -1)).sum()
    return chunked_sum(chunk_kl, z_s, teacher_rows) / n_valid * temperature**2


def topk_kl(
    student_logits: torch.Tensor,
    topk_values: torch.Tensor,
    topk_ids: torch.Tensor,
    mask: torch.Tensor,
    lse: torch.Tensor | None = None,
    *,
    variant: str = "renorm",
    temperature: float = 1.0,
) -> torch.Tensor:
    """KL against a cached top-k teacher, mean over valid tokens. See the two variants below.

    Args:
        student_logits: ``[B, L, V]``.
        topk_values: ``[B, L, k]`` teacher logits at T=1, sorted descending.
        topk_ids: ``[B, L, k]`` their vocabulary ids, any int or float dtype holding integers.
        mask: ``[B, L]``.
        lse: ``[B, L]`` teacher logsumexp over the full vocabulary at T=1; required by ``other``.
        variant: ``"renorm"`` or ``"other"``.
        temperature: T for ``renorm``; ``other`` accepts only 1.0 (see ``topk_kl_other``).
    """
    if variant == "renorm":
        return topk_kl_renorm(student_logits, topk_values, topk_ids, mask, temperature=temperature)
    if variant == "other":
        if lse is None:
            raise LossError("the 'other' top-k KL needs the cached logsumexp (logits/lse)")
        return topk_kl_other(student_logits, topk_values, topk_ids, lse, mask, temperature=temperature)
    raise LossError(f"unknown top-k KL variant {variant!r}; choose one of {', '.join(TOPK_VARIANTS)}")


def cached_topk(targets: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k cache's teacher as ``topk_kl`` takes it: ``(values [B, L, k], ids [B, L, k], lse [B, L])``.

    fp16 caches store the logits and their logsumexp; log-prob caches (``--topk-values logprob``) store
    log-probabilities, whose logsumexp is 0. Both variants of ``topk_kl`` then read either alike (``renorm`` is
    blind to a per-token shift; ``other`` takes ``exp(value - lse)``).
    """
    values, lse = targets["logits/topk_values"], targets.get("logits/lse")
    return values, targets["logits/topk_ids"], values.new_zeros(values.shape[:-1]) if lse is None else lse


def topk_kl_renorm(
    student_logits: torch.Tensor,
    topk_values: torch.Tensor,
    topk_ids: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Renormalised top-k KL: both sides' softmax taken over the teacher's k ids only, at temperature T.

    T applies exactly here (both distributions live on the same k ids), and the result is scaled by T² like
    ``kd_kl``, so the gradient scale does not depend on T.

    Args:
        student_logits: ``[B, L, V]``; topk_values, topk_ids: ``[B, L, k]``; mask: ``[B, L]``.

    Returns:
        Scalar: T² · mean over valid tokens of KL(p_t^k ‖ p_s^k).
    """
    _check_temperature(temperature)
    n_valid = count_valid(bool_mask(mask, student_logits))
    z_s, values, ids = _topk_rows(student_logits, topk_values, topk_ids, mask)
    student_on_ids = torch.gather(z_s, 1, ids).float()  # k of V: no full-vocabulary term, no chunks needed
    log_t = F.log_softmax(values / temperature, dim=-1)
    log_s = F.log_softmax(student_on_ids / temperature, dim=-1)
    return kl_terms(log_t, log_s).sum() / n_valid * temperature**2


def topk_kl_other(
    student_logits: torch.Tensor,
    topk_values: torch.Tensor,
    topk_ids: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Other-bucket top-k KL over k+1 buckets: the k ids' full-vocabulary probabilities, plus the leftover mass.

    The teacher's buckets are ``exp(value - lse)`` and ``1 - Σ`` of those. The cached lse is the T=1
    logsumexp, and the tail logits are not cached, so the teacher's full-vocabulary probabilities are known
    exactly only at T=1. This variant therefore always works at T=1 on both sides (no T² factor) and refuses
    any other temperature rather than silently approximating; use ``renorm`` for T != 1.

    Args:
        student_logits: ``[B, L, V]``; topk_values, topk_ids: ``[B, L, k]``; lse: ``[B, L]``; mask: ``[B, L]``.

    Returns:
        Scalar: mean over valid tokens of KL(teacher buckets ‖ student buckets).
    """
    if temperature != 1.0:
        raise LossError(
            f"the 'other' top-k KL is exact only at temperature 1 (the cached logsumexp is taken at T=1), "
            f"got {temperature}; use temperature 1, or the 'renorm' variant for T != 1"
        )
    n_valid = count_valid(bool_mask(mask, student_logits))
    z_s, values, ids = _topk_rows(student_logits, topk_values, topk_ids, mask)
    # k == V: there is no tail. Drop the leftover bucket on both sides; the teacher's 1 − Σ would only be
    # rounding noise facing the student's exact −inf.
    buckets = ids.shape[1] if ids.shape[1] >= z_s.shape[1] else ids.shape[1] + 1

    def chunk_kl(z: torch.Tensor, top: torch.Tensor, top_ids: torch.Tensor, lse_t: torch.Tensor) -> torch.Tensor:
        log_t = _teacher_buckets(top, lse_t)[:, :buckets]
        return kl_terms(log_t, _student_buckets(z.float(), top_ids)[:, :buckets]).sum()
    return chunked_sum(chunk_kl, z_s, values, ids, valid_rows(lse, mask).float()) / n_valid


def _teacher_buckets(values: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Teacher log-probabilities of the k+1 buckets, ``[N_v, k+1]``, from values ``[N_v, k]`` and lse ``[N_v]``."""
    log_top = values - lse[:, None]
    # fp16 rounding of the values can push the top-k mass a hair above 1: clamp so the leftover is >= 0.
    leftover = (1.0 - log_top.exp().sum(-1)).clamp_min(0.0)
    return torch.cat([log_top, leftover.log()[:, None]], dim=-1)


def _student_buckets(z_s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Student log-probabilities of the k+1 buckets, ``[N_v, k+1]``, from its full logits ``[N_v, V]``.

    The leftover is ``logsumexp`` over the ids *not* in the top-k minus the full logsumexp: exact even when the
    leftover is tiny, where ``log(1 - Σp)`` would cancel to noise. With k == V (no tail) it is −inf, built
    without a logsumexp over an all −inf row, whose backward would be NaN.
    """
    lse_s = torch.logsumexp(z_s, dim=-1, keepdim=True)
    log_top = torch.gather(z_s, 1, ids) - lse_s
    if ids.shape[1] >= z_s.shape[1]:
        return torch.cat([log_top, torch.full_like(lse_s, float("-inf")).detach()], dim=-1)
    tail = z_s.scatter(1, ids, float("-inf"))
    return torch.cat([log_top, torch.logsumexp(tail, dim=-1, keepdim=True) - lse_s], dim=-1)


def _topk_rows(
    student_logits: torch.Tensor, topk_values: torch.Tensor, topk_ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Valid rows: student logits ``[N_v, V]`` (their own dtype), float32 values ``[N_v, k]``, int64 ids ``[N_v, k]``.

    Ids are converted after selection: padded rows may hold anything, and a NaN cast to int would otherwise
    become an out-of-range index.
    """
    if topk_values.shape != topk_ids.shape or topk_values.shape[:2] != student_logits.shape[:2]:
        raise LossError(
            f"top-k values {tuple(topk_values.shape)}, ids {tuple(topk_ids.shape)} and student logits "
            f"{tuple(student_logits.shape)} do not line up as [B, L, k], [B, L, k], [B, L, V]"
        )
    z_s = valid_rows(student_logits, mask)
    values = valid_rows(topk_values, mask).float()
    ids = valid_rows(topk_ids, mask).long()
    return z_s, values, ids


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise LossError(f"the temperature must be > 0, got {temperature}")
