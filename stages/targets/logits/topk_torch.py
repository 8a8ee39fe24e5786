"""The torch half of ``--logits topk`` (``topk``): the capture of the k largest logits and their logsumexp, and
the top-k KL in its two variants as terms of the vocabulary pass."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.base import KlSetup, LogitSettings
from kdcache.stages.targets.logits.loss_flags import TOPK_VARIANTS
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.topk import as_logprobs
from kdcache.stages.targets.logits.vocab import kernel_feeds, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm
from kdcache.storage import TOPK_MASS


def capture(logits: torch.Tensor, settings: LogitSettings,
            generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``logits/topk_values [..., k]`` in the teacher's dtype (the caller checks their range, then converts
    them), ``logits/topk_ids`` int32, ``logits/lse [...]`` fp32 and the kept mass ``TOPK_MASS [...]``; with a
    ``logprob_step``, fp32 log-probabilities instead of values and no logsumexp."""
    values, ids = torch.topk(logits, settings.top_k, dim=-1, largest=True, sorted=True)
    # The upcast keeps the logsumexp exact for half-precision teachers (a no-op for fp32 ones).
    lse = torch.logsumexp(logits.float(), dim=-1)
    # The probability mass the k entries keep, per token, in fp32 from the full logits: storage records its
    # mean, 5th percentile and minimum per shard (how lossy top-k is), and stores nothing of it.
    mass = torch.exp(values.float() - lse.unsqueeze(-1)).sum(-1)
    kept = {"logits/topk_values": values, "logits/topk_ids": ids.to(torch.int32), "logits/lse": lse,
            TOPK_MASS: mass}
    return as_logprobs(kept) if settings.logprob_step else kept


def chunk_term(logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
               setup: KlSetup) -> ChunkTerm:
    """The top-k KL of variant ``setup.topk_variant`` against the cached top-k."""
    # The other-bucket form puts the teacher's tail mass in one bucket: a true KL over a coarsened
    # vocabulary, unlike the renormalised form, which ignores the tail altogether.
    values, ids, lse = cached_topk(targets)  # a log-prob cache has no logsumexp: 0
    return topk_kl_term(logits, values, ids, mask, lse, variant=setup.topk_variant, temperature=setup.temperature)


def teacher_top1(targets: Mapping[str, torch.Tensor], valid: torch.Tensor, head: TeacherHead | None) -> torch.Tensor:
    """``[N_v]`` the first cached id (the top-k is sorted) at the ``valid [B, L]`` positions."""
    return targets["logits/topk_ids"][valid][:, 0]


# ---- the top-k KL ------------------------------------------------------------------------------------------
def topk_kl_term(student_logits: torch.Tensor | HeadLogits, topk_values: torch.Tensor, topk_ids: torch.Tensor,
                 mask: torch.Tensor, lse: torch.Tensor | None = None, *, variant: str = "renorm",
                 temperature: float = 1.0) -> ChunkTerm:
    """KL against a cached top-k teacher, mean over valid tokens, as a term of a vocabulary pass (``vocab_pass``;
    ``topk_kl`` is its scalar value). See the two variants below.

    Args:
        student_logits: ``[B, L, V]``.
        topk_values: ``[B, L, k]`` teacher logits at T=1, sorted descending.
        topk_ids: ``[B, L, k]`` their vocabulary ids, any int or float dtype holding integers.
        mask: ``[B, L]``.
        lse: ``[B, L]`` teacher logsumexp over the full vocabulary at T=1; required by ``other``.
        variant: ``"renorm"`` or ``"other"``.
        temperature: T for ``renorm``; ``other`` accepts only 1.0 (see ``topk_other_term``).
    """
    if variant == "renorm":
        return topk_renorm_term(student_logits, topk_values, topk_ids, mask, temperature=temperature)
    if variant == "other":
        return topk_other_term(student_logits, topk_values, topk_ids, lse, mask, temperature=temperature)
    raise LossError(f"unknown top-k KL variant {variant!r}; choose one of {', '.join(TOPK_VARIANTS)}")


def cached_topk(targets: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A top-k cache's teacher as ``topk_kl`` takes it: ``(values [B, L, k], ids [B, L, k], lse [B, L])``.

    fp16 caches store the logits and their logsumexp; log-prob caches (``--topk-values logprob``) store
    log-probabilities, whose logsumexp is 0. Both variants of ``topk_kl`` then read either alike (``renorm`` is
    blind to a per-token shift; ``other`` takes ``exp(value - lse)``).
    """
    for name in ("logits/topk_values", "logits/topk_ids"):
        if name not in targets:
            raise LossError(f"the loss needs the cached target {name!r}, but the batch holds "
                            f"{', '.join(sorted(targets))}")
    values, lse = targets["logits/topk_values"], targets.get("logits/lse")
    return values, targets["logits/topk_ids"], values.new_zeros(values.shape[:-1]) if lse is None else lse


def topk_renorm_term(student_logits: torch.Tensor | HeadLogits, topk_values: torch.Tensor, topk_ids: torch.Tensor,
                     mask: torch.Tensor, *, temperature: float = 1.0) -> ChunkTerm:
    """Renormalised top-k KL: both sides' softmax taken over the teacher's k ids only, at temperature T
    (``topk_kl_renorm`` is its scalar value: T² · mean over valid tokens of KL(p_t^k ‖ p_s^k)).

    T applies exactly here (both distributions live on the same k ids), and the result is scaled by T² like
    ``kd_kl``, so the gradient scale does not depend on T. It reads k logits per token: in a pass beside a term
    that builds the full logits, a gather of them; alone, only those k (``HeadRows.on_ids``: a gather of k head rows per
    token, never ``[N, V]``).
    """
    loss_rows.check_temperature(temperature)
    _check_topk(student_logits, topk_values, topk_ids)
    m = loss_rows.bool_mask(mask, student_logits)
    scale = temperature**2 / loss_rows.valid_count(m)

    def row_kl(z: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return _renorm_rows(z.gather(1, ids.long()), values, temperature)

    def alone() -> torch.Tensor:
        ids = loss_rows.valid_rows(topk_ids, m).long()
        if isinstance(student_logits, HeadLogits):  # the HeadRows [N_v, d] behind them: never [N_v, V]
            on_ids = student_logits.select(m).on_ids(ids)
        else:
            on_ids = student_logits[m].gather(1, ids).float()
        return _renorm_rows(on_ids, loss_rows.valid_rows(topk_values, m), temperature).sum() * scale
    return vocab_pass.ChunkTerm(row_kl, m, (topk_values, topk_ids), scale, alone, kernel_feeds.renorm_feed(temperature))


def _renorm_rows(student_on_ids: torch.Tensor, values: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[C]`` KL over the k ids, from the student's ``[C, k]`` logits at them and the teacher's ``[C, k]``."""

    log_t = F.log_softmax(values.float() / temperature, dim=-1)
    log_s = F.log_softmax(student_on_ids.float() / temperature, dim=-1)
    return loss_rows.kl_terms(log_t, log_s).sum(-1)


def topk_other_term(student_logits: torch.Tensor | HeadLogits, topk_values: torch.Tensor, topk_ids: torch.Tensor,
                    lse: torch.Tensor | None, mask: torch.Tensor, *, temperature: float = 1.0) -> ChunkTerm:
    """Other-bucket top-k KL over k+1 buckets: the k ids' full-vocabulary probabilities, plus the leftover mass
    (``topk_kl_other`` is its scalar value: mean over valid tokens of KL(teacher buckets ‖ student buckets)).

    The teacher's buckets are ``exp(value - lse)`` and ``1 - Σ`` of those. The cached lse is the T=1
    logsumexp, and the tail logits are not cached, so the teacher's full-vocabulary probabilities are known
    exactly only at T=1. This variant therefore always works at T=1 on both sides (no T² factor) and refuses
    any other temperature rather than silently approximating; use ``renorm`` for T != 1.
    """
    if lse is None:
        raise LossError("the 'other' top-k KL needs the cached logsumexp (logits/lse)")
    if temperature != 1.0:
        raise LossError(
            f"the 'other' top-k KL is exact only at temperature 1 (the cached logsumexp is taken at T=1), "
            f"got {temperature}; use temperature 1, or the 'renorm' variant for T != 1"
        )
    _check_topk(student_logits, topk_values, topk_ids)
    m = loss_rows.bool_mask(mask, student_logits)
    # k == V: there is no tail. Drop the leftover bucket on both sides; the teacher's 1 − Σ would only be
    # rounding noise facing the student's exact −inf.
    k = topk_ids.shape[-1]
    buckets = k if k >= student_logits.shape[-1] else k + 1

    def row_kl(z: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, lse_t: torch.Tensor) -> torch.Tensor:
        # The teacher's k+1 buckets ``[N_v, k+1]`` from values ``[N_v, k]`` and lse ``[N_v]``: exp(value - lse)
        # and the leftover; fp16 rounding of the values can push the
        # top-k mass a hair above 1, so the leftover is clamped to >= 0.
        log_top = values.float() - lse_t.float()[:, None]
        leftover = (1.0 - log_top.exp().sum(-1)).clamp_min(0.0)
        log_t = torch.cat([log_top, leftover.log()[:, None]], dim=-1)[:, :buckets]
        return loss_rows.kl_terms(log_t, _student_buckets(z, ids.long())[:, :buckets]).sum(-1)
    # No kernel feed: the student's tail mass needs a logsumexp over the vocabulary less the k ids (kernel_feeds).
    return vocab_pass.ChunkTerm(row_kl, m, (topk_values, topk_ids, lse), 1.0 / loss_rows.valid_count(m))


def _student_buckets(z_s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Student log-probabilities of the k+1 buckets, ``[N_v, k+1]``, from its full logits ``[N_v, V]``.

    The leftover is ``logsumexp`` over the ids *not* in the top-k minus the full logsumexp: exact even when the
    leftover is tiny, where ``log(1 - Σp)`` would cancel to noise. With k == V (no tail) it is −inf, built
    without a logsumexp over an all −inf row, whose backward would be NaN.
    """
    if ids.shape[1] >= z_s.shape[1]:
        lse_s = torch.logsumexp(z_s, dim=-1, keepdim=True)
        log_top = torch.gather(z_s, 1, ids) - lse_s
        return torch.cat([log_top, torch.full_like(lse_s, float("-inf")).detach()], dim=-1)
    # The gradient written out (loss_rows.BucketLogProbs): autograd's chain held four more [C, V] buffers.
    return loss_rows.BucketLogProbs.apply(z_s, ids)


def _check_topk(student_logits: torch.Tensor | HeadLogits, topk_values: torch.Tensor,
                topk_ids: torch.Tensor) -> None:
    """Values and ids ``[B, L, k]`` beside student logits ``[B, L, V]``, else a ``LossError`` naming the shapes.

    The ids are converted to int64 only on the rows a pass selects: padded rows may hold anything, and a NaN cast
    to int would become an out-of-range index.
    """
    if topk_values.shape != topk_ids.shape or topk_values.shape[:2] != student_logits.shape[:2]:
        raise LossError(
            f"top-k values {tuple(topk_values.shape)}, ids {tuple(topk_ids.shape)} and student logits "
            f"{tuple(student_logits.shape)} do not line up as [B, L, k], [B, L, k], [B, L, V]"
        )


topk_kl = vocab_pass.as_loss(topk_kl_term, "topk_kl")
topk_kl_renorm = vocab_pass.as_loss(topk_renorm_term, "topk_kl_renorm")
topk_kl_other = vocab_pass.as_loss(topk_other_term, "topk_kl_other")
