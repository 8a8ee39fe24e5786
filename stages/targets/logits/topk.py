"""``--logits topk``: per token the k largest teacher logits (sorted descending), their ids and the fp32
logsumexp at T=1, from which exact full-vocabulary log-probabilities of the k are rebuilt; or, with
``--topk-values logprob``, the k log-probabilities themselves (storage quantises them; no logsumexp).

Its stage-two term is ``topk_kl``: ``renorm`` (both softmaxes over the teacher's k ids, any T) or ``other``
(k+1 buckets, the teacher's tail mass in one, exact at T=1 only). Eval reports the ``other`` form. Torch-free: the
capture and the terms are its torch half, ``topk_torch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdcache.stages.targets.logits.base import CacheLogits, LogitFlags, LogitKind, register
from kdcache.stages.targets.logits.loss_flags import LogitLossFlags
from kdcache.storage import TOPK_LAYOUT

if TYPE_CHECKING:
    import torch

# --topk-values logprob stores log-probs on a grid of this many tolerances: a hair under 2, so that a stored value
# (within step/2 of the fp32 log-prob) stays within the tolerance of the exact one despite fp32 rounding (~1e-6).
STEP_PER_TOLERANCE = 1.99


@register
class TopK(LogitKind):
    """The top-k logits with their logsumexp (see the module docstring)."""

    layout = TOPK_LAYOUT
    ranked = True
    term = "topk_kl"
    kl_form = "top-k + other bucket"
    logprob_values = True
    key_array = "logits/topk_ids"

    def option_problems(self, options: LogitFlags) -> list[str]:
        return [f"top_k: got {options.top_k}, must be >= 1"] if options.top_k < 1 else []

    def teacher_problems(self, teacher: str, one_stream: bool, causal: bool, vocab: int, top_k: int) -> list[str]:
        if top_k > vocab:
            return [f"top_k {top_k} is larger than the teacher's vocabulary of {vocab} tokens"]
        return []

    def spec_fields(self, options: LogitFlags, argument: int) -> dict[str, Any]:
        step = STEP_PER_TOLERANCE * options.logprob_tolerance if options.topk_values == "logprob" else 0.0
        return {"top_k": options.top_k, "samples": 0, "logprob_step": step}

    def capture_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens

    def loss_problems(self, spec: CacheLogits, loss: LogitLossFlags) -> list[str]:
        if loss.topk_kl == "other" and loss.temperature != 1:
            return [f"--topk-kl other rebuilds full-vocabulary probabilities from the cached logsumexp, which "
                    f"is exact only at T=1, but --temperature is {loss.temperature:g}; use --temperature 1, "
                    "or --topk-kl renorm (which applies any temperature)"]
        return []

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"top-{info['top_k']} of V={info['vocab_size']}"


def as_logprobs(kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Top-k values as fp32 log-probabilities (values minus the logsumexp), the logsumexp dropped: what a cache
    with ``--topk-values logprob`` keeps (storage quantises them and records the error per shard)."""
    if "logits/lse" not in kept:
        return kept
    out = {k: v for k, v in kept.items() if k != "logits/lse"}
    out["logits/topk_values"] = kept["logits/topk_values"].float() - kept["logits/lse"][..., None]
    return out
