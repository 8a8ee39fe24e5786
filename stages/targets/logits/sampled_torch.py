"""The torch half of ``--logits sampled:N`` (``sampled``): the draws from the teacher's softmax and the unbiased
estimate of the KD KL from them, as a term of the vocabulary pass."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from kdcache.stages.targets.logits.base import KlSetup, LogitSettings
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.vocab import kernel_feeds, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm


def capture(logits: torch.Tensor, settings: LogitSettings,
            generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """N = ``settings.samples`` draws with replacement from softmax(logits / T) per token, T =
    ``settings.sample_temperature``, kept as distinct ids and counts.

    Returns, each ``[..., N]`` (the distinct ids first, ascending; unused slots repeat the last id, with count 0 and
    log-probability 0):
    ``logits/sample_ids`` int32, ``logits/sample_counts`` uint8 and ``logits/sample_logp`` float32, the teacher's
    log-probability of each id at T: what the estimator of ``sampled_kl`` needs.
    """
    log_p = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]) / settings.sample_temperature, dim=-1)
    draws, _ = torch.multinomial(log_p.exp(), settings.samples, replacement=True, generator=generator).sort(dim=1)
    first = torch.ones_like(draws, dtype=torch.bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    slot = first.long().cumsum(1) - 1  # each draw's distinct-id slot
    counts = torch.zeros_like(draws).scatter_add_(1, slot, torch.ones_like(draws))
    ids = torch.zeros_like(draws).scatter_(1, slot, draws)
    last = ids.gather(1, first.sum(1, keepdim=True) - 1)
    ids = torch.where(counts > 0, ids, last)  # unused slots repeat the last id: rows stay sorted (gap-coded on disk)
    logp = log_p.gather(1, ids).masked_fill(counts == 0, 0.0)
    shape = (*logits.shape[:-1], settings.samples)
    return {"logits/sample_ids": ids.to(torch.int32).reshape(shape),
            "logits/sample_counts": counts.to(torch.uint8).reshape(shape), "logits/sample_logp": logp.reshape(shape)}


def chunk_term(logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
               setup: KlSetup) -> ChunkTerm:
    """The estimate of the KD KL from the cached draws, at ``setup.temperature`` (the cache's)."""
    return sampled_kl_term(logits, targets["logits/sample_ids"], targets["logits/sample_counts"],
                           targets["logits/sample_logp"], mask, setup.temperature)


def teacher_top1(targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                 head: TeacherHead | None) -> torch.Tensor:
    """The likeliest of the drawn ids: the top-1 whenever it was drawn."""
    logp = targets["logits/sample_logp"][valid].masked_fill(targets["logits/sample_counts"][valid] == 0,
                                                             float("-inf"))
    return targets["logits/sample_ids"][valid].gather(1, logp.argmax(-1, keepdim=True))[:, 0]


def sampled_kl_term(student_logits: torch.Tensor | HeadLogits, ids: torch.Tensor, counts: torch.Tensor,
                    logp: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> ChunkTerm:
    """KD KL estimated from draws of the teacher's distribution (caches written with ``--logits sampled:N``), as a
    term of a vocabulary pass (``vocab_pass``; ``sampled_kl`` is its scalar value).

    With N draws x_1..x_N from the teacher's p_T = softmax(z_t / T) per token, kept as distinct ids i with counts
    c_i and the teacher's log p_T(i),

        KL(p_T ‖ s_T) ≈ (1/N) Σ_n [log p_T(x_n) − log s_T(x_n)] = Σ_i (c_i / N) · (log p_T(i) − log s_T(i)),

    with s_T = softmax(z_s / T). Its expectation over the draws is the KL exactly, so its gradient is the full KD
    gradient in expectation, where a top-k KL is biased. Scaled by T² like ``kd_kl``; T must be the temperature
    the cache drew at.

    Args:
        student_logits: ``[B, L, V]``, or the ``HeadLogits`` behind them.
        ids, counts, logp: ``[B, L, N]`` the cached ``logits/sample_*`` arrays (count 0 marks an unused slot).
        mask: ``[B, L]``.
        temperature: T, the cache's ``sample_temperature``.

    Its value: T² · mean over valid tokens of the estimate.
    """
    loss_rows.check_temperature(temperature)
    m = loss_rows.bool_mask(mask, student_logits)

    def row_estimate(z: torch.Tensor, drawn: torch.Tensor, count: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
        log_s = F.log_softmax(z / temperature, dim=-1).gather(1, drawn.long())
        weights = count.float() / count.float().sum(-1, keepdim=True).clamp_min(1.0)
        return (weights * (log_p.float() - log_s)).sum(-1)
    return vocab_pass.ChunkTerm(row_estimate, m, (ids, counts, logp), temperature**2 / loss_rows.valid_count(m),
                                feed=kernel_feeds.sampled_feed(temperature))


sampled_kl = vocab_pass.as_loss(sampled_kl_term, "sampled_kl")
