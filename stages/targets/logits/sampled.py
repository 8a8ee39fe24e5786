"""``--logits sampled:N``: per token, N draws with replacement from the teacher's softmax at
``--sample-temperature``, kept as the distinct ids (ascending), how often each was drawn and the teacher's
log-probability of each at that temperature (Anshumann et al., ACL 2025, arXiv 2503.16870).

Its stage-two term ``sampled_kl`` is an unbiased estimate of the KD KL, which exists only at the temperature the
cache drew at: that is the default training temperature, and any other is refused. Eval reports it without T².
Not yet for encoder-decoder teachers. Torch-free: the capture and the term are its torch half,
``sampled_torch``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdcache.stages.targets.logits.base import (
    CacheLogits,
    KlSetup,
    LogitFlags,
    LogitKind,
    LogitKindError,
    register,
)
from kdcache.stages.targets.logits.loss_flags import LogitLossFlags
from kdcache.storage import SAMPLED_LAYOUT

if TYPE_CHECKING:
    import torch

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

    def spec_fields(self, options: LogitFlags, argument: int) -> dict[str, Any]:
        return {"top_k": 0, "samples": argument, "logprob_step": 0.0}

    def capture_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens

    def loss_problems(self, spec: CacheLogits, loss: LogitLossFlags) -> list[str]:
        problems = super().loss_problems(spec, loss)
        if not problems and loss.temperature != spec.sample_temperature:
            problems.append(f"temperature {loss.temperature}: the KL needs the temperature the cache's samples were "
                            f"drawn at, {spec.sample_temperature} (its --sample-temperature); train with "
                            f"--temperature {spec.sample_temperature}, or re-run stage one at {loss.temperature}")
        return problems

    def default_temperature(self, spec: CacheLogits) -> float | None:
        return float(spec.sample_temperature)

    def eval_kl(self, logits: torch.Tensor, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                setup: KlSetup) -> torch.Tensor:
        """The estimate exists only at the cache's temperature (``setup.temperature``); reported without T²."""
        return self.loss(logits, targets, mask, setup) / setup.temperature**2

    def kl_label(self, spec_temperature: float) -> str:
        return self.kl_form + (f" at T={spec_temperature:g}" if spec_temperature != 1 else "")

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"{info['samples']} draws per token at T={info['sample_temperature']:g}, V={info['vocab_size']}"
