"""How each vocabulary term feeds the fused kernel (``fused_vocab``): its value and gradient per row, written out
from the kernel's per-row statistics and a gather of a few logits per row.

Every term here has a gradient of one shape,

    dz = a · softmax(z) + a_T · softmax(z / T) + a_t · softmax(z_t / T) + Σ_i at_ids_i · e(ids_i),

so the kernel needs only the coefficients ``a``, ``a_T``, ``a_t`` per row and a ``[C, k]`` scatter afterwards:

| term | value per row | a | a_T | a_t | ids, at_ids |
| --- | --- | --- | --- | --- | --- |
| CE | lse − z_y | 1 | | | y, −1 |
| full / head KL at T | cross − lse(z_t/T) + lse(z/T) | | 1/T | −1/T | |
| sampled at T | Σ w_i (log p_i − z_i/T + lse(z/T)) | | W/T | | ids, −w/T |
| top-k renormalised at T | KL over the k ids | | | | ids, (q_k − p_k)/T |

(w_i = c_i / Σ c, W = Σ w). The top-k KL with the tail in one bucket (``--topk-kl other``) keeps the pure-torch
pass: its student tail mass 1 − Σ_k softmax(z) cancels to noise in float32 for a confident row, and its exact
form, a logsumexp over the vocabulary less the k ids, needs a masked sum the kernel does not have yet.
The derivations are in docs/losses.md; the pure-torch terms (``vocab_pass``) are the reference the tests hold
these to. A logit kind attaches its feed to its ``ChunkTerm``; a term without one keeps the pure-torch pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kdcache.stages.targets.logits.vocab.loss_rows import kl_terms


@dataclass(frozen=True)
class RowStats:
    """One chunk's per-row statistics, ``[C]`` float32 each.

    Attributes:
        lse: ``logsumexp(z)``.
        lse_t: ``logsumexp(z / T)`` (the same tensor as ``lse`` at T = 1).
        teacher_lse: ``logsumexp(z_t / T)``; None without a dense teacher.
        cross: ``Σ_j softmax(z_t/T)_j · (z_t − z)_j / T``, entries with no teacher mass adding 0; None likewise.
    """

    lse: torch.Tensor
    lse_t: torch.Tensor
    teacher_lse: torch.Tensor | None = None
    cross: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkView:
    """What a feed reads of one chunk: the kernel's statistics, the chunk's student
    logits ``[C, V]`` before the gradient overwrites them, and the rows the term counts ``keep [C]``."""

    stats: RowStats
    logits: torch.Tensor
    keep: torch.Tensor

    def ids(self, raw: torch.Tensor) -> torch.Tensor:
        """``[C, k]`` int64 ids safe to gather: a row the term does not count may hold anything (NaN cast to an
        int is out of range), so its ids become 0."""
        ids = raw.long().clamp(0, self.logits.shape[1] - 1)
        return torch.where(self.keep[:, None], ids, torch.zeros_like(ids))

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """``[C, k]`` float32 student logits at ``ids``."""
        return self.logits.gather(1, ids).float()


@dataclass(frozen=True)
class RowGrad:
    """One term's value ``[C]`` and the coefficients of its gradient (None: that part is absent)."""

    value: torch.Tensor
    a: torch.Tensor | None = None
    a_t: torch.Tensor | None = None
    a_teacher: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    at_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class KernelFeed:
    """A term as the fused kernel takes it.

    Attributes:
        rows: ``rows(view, *the term's target rows of the chunk) -> RowGrad``.
        temperature: the T of the statistics at T it reads (``lse_t``, the teacher's, ``a_t``); None: it reads
            none (CE, the renormalised KL), so it shares a pass with a term at any T.
        teacher: ``teacher(*target rows) -> [C, V]`` dense teacher logits the kernel reads beside the student's
            (the full cache's rows, or the teacher's head on its cached last layer); None: none.
    """

    rows: Callable[..., RowGrad]
    temperature: float | None = None
    teacher: Callable[..., torch.Tensor] | None = None


def ce_feed() -> KernelFeed:
    """Cross-entropy against ``labels [C]`` (valid ids everywhere)."""

    def rows(view: ChunkView, labels: torch.Tensor) -> RowGrad:
        ids = view.ids(labels[:, None])
        ones = torch.ones_like(view.stats.lse)
        return RowGrad(view.stats.lse - view.at(ids)[:, 0], a=ones, ids=ids, at_ids=-ones[:, None])
    return KernelFeed(rows)


def dense_kl_feed(temperature: float, teacher: Callable[..., torch.Tensor]) -> KernelFeed:
    """KL(softmax(z_t/T) ‖ softmax(z/T)) against dense teacher logits ``teacher(*targets) [C, V]``."""

    def rows(view: ChunkView, *targets: torch.Tensor) -> RowGrad:
        s = view.stats
        assert s.cross is not None and s.teacher_lse is not None  # the kernel read this feed's teacher
        value = s.cross - s.teacher_lse + s.lse_t
        inv = torch.full_like(value, 1.0 / temperature)
        return RowGrad(value, a_t=inv, a_teacher=-inv)
    return KernelFeed(rows, temperature, teacher)


def sampled_feed(temperature: float) -> KernelFeed:
    """The unbiased sampled KL estimate from drawn ``ids``, ``counts`` and the teacher's ``log_p``, ``[C, N]``."""

    def rows(view: ChunkView, drawn: torch.Tensor, counts: torch.Tensor, log_p: torch.Tensor) -> RowGrad:
        ids = view.ids(drawn)
        w = counts.float() / counts.float().sum(-1, keepdim=True).clamp_min(1.0)
        log_s = view.at(ids) / temperature - view.stats.lse_t[:, None]
        value = (w * (log_p.float() - log_s)).sum(-1)
        return RowGrad(value, a_t=w.sum(-1) / temperature, ids=ids, at_ids=-w / temperature)
    return KernelFeed(rows, temperature)


def renorm_feed(temperature: float) -> KernelFeed:
    """The renormalised top-k KL at T: both softmaxes over the teacher's k ids (``values``, ``ids`` ``[C, k]``)."""

    def rows(view: ChunkView, values: torch.Tensor, raw_ids: torch.Tensor) -> RowGrad:
        ids = view.ids(raw_ids)
        log_t = F.log_softmax(values.float() / temperature, dim=-1)
        log_s = F.log_softmax(view.at(ids) / temperature, dim=-1)
        at_ids = (log_s.exp() - log_t.exp()) / temperature
        return RowGrad(kl_terms(log_t, log_s).sum(-1), ids=ids, at_ids=at_ids)
    return KernelFeed(rows)  # its T is its own: it reads k logits, no statistic at T
