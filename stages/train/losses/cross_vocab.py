"""Losses across vocabularies (``--cross-tokenizer``): the teacher's cached top-k against a student with its own
tokenizer, compared span by span (``stages.train.cross.align``).

Shapes: ``B`` batch, ``K`` spans (padded per batch), ``k`` cached top-k, ``V_s`` the student's vocabulary,
``L_t`` / ``L_s`` teacher / student tokens. Span-level inputs are gathered first (``span_rows`` at each span's
last token, ``span_mean`` over its tokens), so every loss here reads ``[B, K, ...]`` tensors and a span mask
``[B, K]``. A padded span reads its row's first token and is weighed out (``_rows``); ``cross_vocab_term`` gives
either loss as a vocabulary-pass term, so the span logits are built chunk by chunk from the student's head.

* ``uld_loss``: Universal Logit Distillation (Boizard et al., 2024, "Towards Cross-Tokenizer Distillation: the
  Universal Logit Distillation Loss for LLMs"): the L1 (Wasserstein-1 between sorted supports) distance between
  the teacher's sorted probabilities and the student's, here the cached top-k ``exp(value - lse)`` against the
  student's own k largest softmax probabilities.
* ``gold_loss``: the hybrid of TRL's GOLD trainer: exact KL over the teacher's top-k ids whose token strings the
  student's vocabulary also holds (``shared_vocab``), ULD over the rest, weighted by the teacher's renormalised
  top-k mass on each part. With one tokenizer on both sides every id is shared and it is the ordinary renormalised
  top-k KL (``topk_kl_renorm``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.loss_rows import bool_mask, kl_terms, valid_count
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm


def span_rows(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[B, K, ...]``: the rows of ``x [B, L, ...]`` at each span's last token ``last [B, K]`` (``-1``: a padded
    span, which reads row 0 and is masked by the caller)."""
    index = last.clamp_min(0).long()
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return torch.gather(x, 1, index)


def span_mean(x: torch.Tensor, span: torch.Tensor, spans: int) -> torch.Tensor:
    """``[B, K, d]``: the mean of ``x [B, L, d]`` over each span's tokens (``span [B, L]``, ``-1`` for none).

    A span with no token (padding) is 0.
    """
    b, _, d = x.shape
    kept = span >= 0
    slot = torch.where(kept, span, torch.full_like(span, spans)).long()  # an extra slot for tokens in no span
    sums = x.new_zeros(b, spans + 1, d, dtype=torch.float32).scatter_add_(
        1, slot[..., None].expand(-1, -1, d), x.float())
    counts = x.new_zeros(b, spans + 1, dtype=torch.float32).scatter_add_(1, slot, kept.float())
    return (sums / counts.clamp_min(1.0)[..., None])[:, :spans]


def shared_vocab(teacher_vocab: Mapping[str, int], student_vocab: Mapping[str, int], size: int) -> torch.Tensor:
    """``[V_t]`` int64: per teacher id the student id of the same token string, ``-1`` where the student has none.

    Args:
        teacher_vocab, student_vocab: token string -> id (``tokenizer.get_vocab()``).
        size: the teacher's vocabulary size (ids beyond its tokenizer's, e.g. padded embeddings, stay ``-1``).
    """
    out = torch.full((size,), -1, dtype=torch.long)
    for token, t_id in teacher_vocab.items():
        s_id = student_vocab.get(token)
        if s_id is not None and t_id < size:
            out[t_id] = s_id
    return out


def _sorted_student(z_s: torch.Tensor, k: int, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, k]`` the student's k largest probabilities (softmax over its whole vocabulary), descending, zero padded
    when ``V_s < k``; ids flagged in ``hidden [N, V_s]`` count as 0 (GOLD's ULD part skips the shared ones)."""
    p = F.softmax(z_s.float(), dim=-1)
    if hidden is not None:
        p = p.masked_fill(hidden, 0.0)
    top = torch.topk(p, min(k, p.shape[-1]), dim=-1).values
    return F.pad(top, (0, k - top.shape[-1]))


def uld_loss(student_logits: torch.Tensor, topk_values: torch.Tensor, lse: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:
    """Mean over valid spans of Σ_j |p_t(j) − p_s(j)|, both sides' probabilities sorted descending.

    Args:
        student_logits: ``[B, K, V_s]`` at each span's last student token.
        topk_values: ``[B, K, k]`` the cached teacher top-k at its last teacher token (logits at T=1, or
            log-probabilities with ``lse`` 0), sorted descending.
        lse: ``[B, K]`` the teacher's logsumexp (0 for a log-prob cache).
        mask: ``[B, K]`` spans that count.
    """
    keep = bool_mask(mask, student_logits).reshape(-1)
    return _masked_mean(uld_rows(_rows(student_logits).float(), _rows(topk_values), _rows(lse)), keep)


def uld_rows(z_s: torch.Tensor, values: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``[N]`` ULD per row: ``z_s [N, V_s]`` float32, ``values [N, k]``, ``lse [N]`` (``uld_loss``)."""
    p_t = (values.float() - lse.float()[:, None]).exp()
    return (p_t - _sorted_student(z_s, p_t.shape[-1])).abs().sum(-1)


def gold_loss(student_logits: torch.Tensor, topk_values: torch.Tensor, topk_ids: torch.Tensor, lse: torch.Tensor,
              mask: torch.Tensor, shared: torch.Tensor, *, temperature: float = 1.0,
              variant: str = "renorm") -> torch.Tensor:
    """GOLD's hybrid, mean over valid spans of ``w · T² KL(q_S ‖ r_S) + (1 − w) · ULD_U``.

    ``q = softmax(values / T)`` over the teacher's k ids; ``S`` the ids the student shares (``shared[id] >= 0``),
    ``U`` the rest; ``w = Σ_S q``; ``q_S`` and ``r_S`` the teacher's and the student's softmax (at T) over the
    shared ids alone (the student's at their student ids); ``ULD_U = Σ_j |a(j) − b(j)|`` with ``a`` the teacher's
    probabilities ``exp(value − lse)`` on ``U`` sorted descending (zero padded to k) and ``b`` the student's k
    largest probabilities outside the shared vocabulary (every student id that some teacher id maps to, as TRL's
    GOLD excludes matched tokens from its ULD part). The weight ``w`` is kdcache's choice: TRL weighs the parts
    by fixed or count-based weights.

    ``variant`` is the run's ``--topk-kl``, so one tokenizer on both sides gives the ordinary top-k KL of either
    kind: ``renorm`` as above; ``other`` (T = 1 only) compares full-vocabulary probabilities on the shared ids plus
    one bucket for the rest of each side's mass: p_t = exp(value − lse), p_s the student's softmax over its whole
    vocabulary at the mapped ids. Only ``other`` moves the student's absolute mass onto the shared tokens the
    teacher ranks high (``renorm`` sees their ratios alone).

    Args:
        student_logits: ``[B, K, V_s]``; topk_values, topk_ids: ``[B, K, k]``; lse, mask: ``[B, K]``.
        shared: ``[V_t]`` int64 from ``shared_vocab``, on the same device.
        temperature: T of the exact part (ULD compares probabilities at T=1).
    """
    keep = bool_mask(mask, student_logits).reshape(-1)
    student_shared = shared_student_ids(shared, student_logits.shape[-1])
    rows = gold_rows(_rows(student_logits).float(), _rows(topk_values), _rows(topk_ids), _rows(lse), shared,
                     student_shared, temperature=temperature, variant=variant)
    return _masked_mean(rows, keep)


def gold_rows(z_s: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, shared: torch.Tensor,
              student_shared: torch.Tensor, *, temperature: float, variant: str) -> torch.Tensor:
    """``[N]`` GOLD per row (``gold_loss``): ``z_s [N, V_s]`` float32, ``values`` / ``ids [N, k]``, ``lse [N]``;
    ``student_shared [V_s]`` bool from ``shared_student_ids``."""
    if temperature <= 0:
        raise LossError(f"temperature must be > 0, got {temperature}")
    values, ids = values.float(), ids.long()
    mapped = shared[ids]  # [N, k] student ids, -1 where unshared
    is_shared = mapped >= 0
    w = (F.softmax(values / temperature, dim=-1) * is_shared).sum(-1)
    if variant == "other":
        exact = _shared_other_kl(z_s, values - lse.float()[:, None], mapped, is_shared)
    elif variant == "renorm":
        exact = _shared_kl(z_s, values, mapped, is_shared, temperature)
    else:
        raise LossError(f"unknown top-k KL variant {variant!r} for gold; choose renorm or other")
    a = torch.where(is_shared, torch.zeros_like(values), (values - lse.float()[:, None]).exp())
    a = torch.sort(a, dim=-1, descending=True).values
    uld = (a - _sorted_student(z_s, a.shape[-1], student_shared[None])).abs().sum(-1)
    return w * exact + (1.0 - w) * uld


def cross_vocab_term(kind: str, logits: torch.Tensor | HeadLogits, topk_values: torch.Tensor,
                     topk_ids: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor, shared: torch.Tensor,
                     student_shared: torch.Tensor, *, temperature: float = 1.0, variant: str = "renorm") -> ChunkTerm:
    """``uld_loss`` or ``gold_loss`` (``kind``) as a term of a vocabulary pass (``vocab_pass``), so the student's
    ``[B, K, V_s]`` span logits are built chunk by chunk from ``HeadLogits`` (memory ∝ chunk × V_s) or read from
    materialised logits; same value as the loss. ``mask [B, K]``: the counted spans."""
    keep = bool_mask(mask, logits)
    if kind == "uld":
        return ChunkTerm(uld_rows, keep, (topk_values, lse), 1.0 / valid_count(keep))

    def rows(z: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, lse_rows: torch.Tensor) -> torch.Tensor:
        return gold_rows(z, values, ids, lse_rows, shared, student_shared, temperature=temperature, variant=variant)
    return ChunkTerm(rows, keep, (topk_values, topk_ids, lse), 1.0 / valid_count(keep))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, K, ...]`` -> ``[B·K, ...]``: every span row, counted or not. Unlike the token losses, which select
    their rows (``valid_rows``: a boolean index, so a host sync), the span losses compute every row and weigh:
    ``span_rows`` reads a real token for every row (a padded span reads the row's first), so no row holds the
    inf or NaN that selection guards against, and these functions need no sync. (Training runs them through
    ``cross_vocab_term`` in a vocabulary pass, which selects its rows with one index, as on the ordinary path.)"""
    return x.reshape(-1, *x.shape[2:])


def _masked_mean(per_row: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The mean of ``per_row [N]`` over ``keep [N]`` (0 when none), on the device."""
    return torch.where(keep, per_row, torch.zeros_like(per_row)).sum() / valid_count(keep)


def shared_student_ids(shared: torch.Tensor, student_vocab: int) -> torch.Tensor:
    """``[V_s]`` bool: the student ids some teacher id maps to (the shared vocabulary, TRL's GOLD rule). A scatter
    into one spare slot for the unshared -1s, then dropped: no boolean index, so no host sync."""
    slots = torch.where(shared >= 0, shared, torch.full_like(shared, student_vocab))
    found = torch.zeros(student_vocab + 1, dtype=torch.bool, device=shared.device)
    return found.scatter_(0, slots, True)[:student_vocab]


def _shared_kl(z_s: torch.Tensor, values: torch.Tensor, mapped: torch.Tensor, is_shared: torch.Tensor,
               temperature: float) -> torch.Tensor:
    """``[N]`` T² KL(q_S ‖ r_S) per row; 0 for a row with no shared id."""
    any_shared = is_shared.any(-1, keepdim=True)
    keep = is_shared | ~any_shared  # a row with none keeps its ids (finite softmax) and is zeroed below
    neg = torch.tensor(float("-inf"), device=values.device)
    log_t = F.log_softmax(torch.where(keep, values / temperature, neg), dim=-1)
    on_ids = torch.gather(z_s, 1, mapped.clamp_min(0)) / temperature
    log_s = F.log_softmax(torch.where(keep, on_ids, neg), dim=-1)
    kl = kl_terms(log_t, torch.where(keep, log_s, torch.zeros_like(log_s))).sum(-1) * temperature**2
    return torch.where(any_shared.squeeze(-1), kl, torch.zeros_like(kl))


def _shared_other_kl(z_s: torch.Tensor, log_t: torch.Tensor, mapped: torch.Tensor,
                     is_shared: torch.Tensor) -> torch.Tensor:
    """``[N]`` KL over the shared ids plus one rest bucket, at T = 1 (``gold_loss``'s ``other``).

    Args:
        z_s: ``[N, V_s]`` student logits; log_t: ``[N, k]`` the teacher's full-vocabulary log-probabilities of its
            k ids; mapped, is_shared: ``[N, k]`` (see ``gold_loss``).
    """
    neg = torch.tensor(float("-inf"), device=z_s.device)
    log_p_t = torch.where(is_shared, log_t, neg)
    log_p_s = torch.where(is_shared, torch.gather(F.log_softmax(z_s, dim=-1), 1, mapped.clamp_min(0)), neg)
    buckets_t = torch.cat([log_p_t, _log_rest(log_p_t)[:, None]], -1)  # [N, k + 1]
    buckets_s = torch.cat([log_p_s, _log_rest(log_p_s)[:, None]], -1)
    # unshared ids are -inf on both sides: 0 · log 0 terms, which kl_terms counts as 0 (given a finite log q)
    both_empty = torch.isinf(buckets_t) & torch.isinf(buckets_s)
    return kl_terms(buckets_t, torch.where(both_empty, 0.0, buckets_s)).sum(-1)


def _log_rest(log_p: torch.Tensor) -> torch.Tensor:
    """``[N]`` log(1 − Σ_j p_j) of ``[N, k]`` log-probabilities (-inf entries add nothing), kept finite: a side
    whose listed ids hold all its mass (up to rounding) leaves a rest of 1e-12."""
    return torch.log1p(-torch.logsumexp(log_p, -1).exp().clamp(max=1.0 - 1e-12))
