"""``--logits sampled:N``: per token, N draws with replacement from the teacher's softmax at
``--sample-temperature``, kept as the distinct ids (ascending), how often each was drawn and the teacher's
log-probability of each at that temperature (Anshumann et al., ACL 2025, arXiv 2503.16870).

Its stage-two term ``sampled_kl`` is an unbiased estimate of the KD KL, which exists only at the temperature the
cache drew at: that is the default training temperature, and any other is refused. Eval reports it without T².
Not yet for encoder-decoder teachers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdcache.lazy_exports import deferred
from kdcache.stages.common.logit_kinds.base import (
    CacheLogits,
    CaptureSettings,
    KlSetup,
    LogitKind,
    LogitKindError,
    LogitOptions,
    LossSettings,
    TeacherHead,
    register,
)
from kdcache.storage import SAMPLED_LAYOUT

if TYPE_CHECKING:
    import torch
    import torch.nn.functional as F

    from kdcache.stages.train.vocab import ChunkTerm, HeadLogits, kernel_feeds, loss_rows, vocab_pass
else:  # torch's side loads on first use, so that the registry and the option checks import without it
    torch, F, kernel_feeds, loss_rows, vocab_pass = deferred(
        "torch", "torch.nn.functional", "kdcache.stages.train.vocab.kernel_feeds",
        "kdcache.stages.train.vocab.loss_rows",         "kdcache.stages.train.vocab.vocab_pass")

MAX_SAMPLES = 255  # the counts are stored as uint8


@register
class Sampled(LogitKind):
    """Draws of the teacher's distribution (see the module docstring)."""

    layout = SAMPLED_LAYOUT
    argument = "N"
    term = "sampled_kl"
    kl_form = "sampled estimate (unbiased)"
    draws = True
    key_array = "logits/sample_ids"

    def parse_argument(self, text: str) -> int:
        if not (re.fullmatch(r"[1-9][0-9]*", text) and int(text) <= MAX_SAMPLES):
            raise LogitKindError(f"logits: got 'sampled:{text}', expected sampled:N with N in 1..{MAX_SAMPLES} "
                                 f"(e.g. sampled:12)")
        return int(text)

    def teacher_problems(self, teacher: str, one_stream: bool, causal: bool, vocab: int, top_k: int) -> list[str]:
        if not one_stream:
            return [f"logits sampled: not yet for encoder-decoder teachers such as {teacher!r}; use --logits topk "
                    f"or full"]
        return []

    def spec_fields(self, options: LogitOptions, argument: int) -> dict[str, Any]:
        return {"top_k": 0, "samples": argument, "logprob_step": 0.0}

    def capture_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens

    def capture(self, logits: torch.Tensor, settings: CaptureSettings,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        return sample_logits(logits, settings.samples, settings.sample_temperature, generator)

    def loss_problems(self, spec: CacheLogits, loss: LossSettings) -> list[str]:
        problems = super().loss_problems(spec, loss)
        if not problems and loss.temperature != spec.sample_temperature:
            problems.append(f"temperature {loss.temperature}: the KL needs the temperature the cache's samples were "
                            f"drawn at, {spec.sample_temperature} (its --sample-temperature); train with "
                            f"--temperature {spec.sample_temperature}, or re-run stage one at {loss.temperature}")
        return problems

    def default_temperature(self, spec: CacheLogits) -> float | None:
        return float(spec.sample_temperature)

    def chunk_term(self, logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                   setup: KlSetup) -> ChunkTerm:
        return sampled_kl_term(logits, targets["logits/sample_ids"], targets["logits/sample_counts"],
                               targets["logits/sample_logp"], mask, setup.temperature)

    def eval_kl(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                setup: KlSetup) -> torch.Tensor:
        """The estimate exists only at the cache's temperature (``setup.temperature``); reported without T²."""
        return self.loss(logits, targets, mask, setup) / setup.temperature**2

    def teacher_top1(self, targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                     head: TeacherHead | None) -> torch.Tensor:
        """The likeliest of the drawn ids: the top-1 whenever it was drawn."""
        logp = targets["logits/sample_logp"][valid].masked_fill(targets["logits/sample_counts"][valid] == 0,
                                                                 float("-inf"))
        return targets["logits/sample_ids"][valid].gather(1, logp.argmax(-1, keepdim=True))[:, 0]

    def kl_label(self, spec_temperature: float) -> str:
        return self.kl_form + (f" at T={spec_temperature:g}" if spec_temperature != 1 else "")

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"{info['samples']} draws per token at T={info['sample_temperature']:g}, V={info['vocab_size']}"


def sample_logits(logits: torch.Tensor, samples: int, temperature: float,
                  generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """``samples`` draws with replacement from softmax(logits / T) per token, kept as distinct ids and counts.

    Returns, each ``[..., N]`` (N = ``samples``; the distinct ids first, ascending; unused slots repeat the last id,
    with count 0 and log-probability 0):
    ``logits/sample_ids`` int32, ``logits/sample_counts`` uint8 and ``logits/sample_logp`` float32, the teacher's
    log-probability of each id at T: what the estimator of ``sampled_kl`` needs.
    """
    log_p = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]) / temperature, dim=-1)
    draws, _ = torch.multinomial(log_p.exp(), samples, replacement=True, generator=generator).sort(dim=1)
    first = torch.ones_like(draws, dtype=torch.bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    slot = first.long().cumsum(1) - 1  # each draw's distinct-id slot
    counts = torch.zeros_like(draws).scatter_add_(1, slot, torch.ones_like(draws))
    ids = torch.zeros_like(draws).scatter_(1, slot, draws)
    last = ids.gather(1, first.sum(1, keepdim=True) - 1)
    ids = torch.where(counts > 0, ids, last)  # unused slots repeat the last id: rows stay sorted (gap-coded on disk)
    logp = log_p.gather(1, ids).masked_fill(counts == 0, 0.0)
    shape = (*logits.shape[:-1], samples)
    return {"logits/sample_ids": ids.to(torch.int32).reshape(shape),
            "logits/sample_counts": counts.to(torch.uint8).reshape(shape), "logits/sample_logp": logp.reshape(shape)}


def sampled_kl(student_logits: torch.Tensor | HeadLogits, ids: torch.Tensor, counts: torch.Tensor, logp: torch.Tensor,
               mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KD KL estimated from draws of the teacher's distribution (caches written with ``--logits sampled:N``).

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

    Returns:
        Scalar: T² · mean over valid tokens of the estimate.
    """
    return vocab_pass.term_value(student_logits, sampled_kl_term(student_logits, ids, counts, logp, mask, temperature))


def sampled_kl_term(student_logits: torch.Tensor | HeadLogits, ids: torch.Tensor, counts: torch.Tensor,
                    logp: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> ChunkTerm:
    """``sampled_kl`` as a term of a vocabulary pass (``vocab_pass``)."""

    loss_rows.check_temperature(temperature)
    m = loss_rows.bool_mask(mask, student_logits)

    def row_estimate(z: torch.Tensor, drawn: torch.Tensor, count: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
        log_s = F.log_softmax(z / temperature, dim=-1).gather(1, drawn.long())
        weights = count.float() / count.float().sum(-1, keepdim=True).clamp_min(1.0)
        return (weights * (log_p.float() - log_s)).sum(-1)
    return vocab_pass.ChunkTerm(row_estimate, m, (ids, counts, logp), temperature**2 / loss_rows.valid_count(m),
                                feed=kernel_feeds.sampled_feed(temperature))
