"""Top-k teacher logits through the LM head in chunks of valid tokens, never as one ``[B, L, V]`` tensor.

A causal LM's forward computes logits for every position of the padded batch, and the logsumexp upcasts all of
it to fp32: at V = 128k, B = 8, L = 2,048 that is 8 GB of fp32 on the teacher's device, for padding included.
Here the base model runs alone, the valid rows of its last hidden state are gathered (``[N_v, d]``), and the
head maps ``chunk`` rows at a time to logits, of which only the top-k, their ids and the fp32 logsumexp are kept.
Peak memory for logits is then ``chunk · V`` (plus its fp32 copy), whatever the batch.

The head is the model's output embedding (with Gemma-style soft-capping or Cohere-style scaling where the config
has them). Because a model may do more between its base and its logits, the first batch is checked against the
model's own forward on its first sequence; on any disagreement the run falls back to the full forward, and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kdcache.stages.common.teacher_head import finish_logits
from kdcache.stages.precompute.targets import CAUSAL_SUFFIXES
from kdcache.storage.spec import TOPK_MASS


def _head_of(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The map from the base model's last hidden state to logits, or None where it is not a plain head."""
    head = model.get_output_embeddings()
    causal_lm = type(model).__name__.endswith(CAUSAL_SUFFIXES)
    if head is None or getattr(model, "base_model", model) is model or not causal_lm:
        return None
    scale = getattr(model.config, "logit_scale", None)
    cap = getattr(model.config, "final_logit_softcapping", None)

    def apply(hidden: torch.Tensor) -> torch.Tensor:
        return finish_logits(head(hidden), scale, cap)
    return apply


def logit_targets(logits: Any, kind: str | None, top_k: int, *, samples: int = 0, temperature: float = 1.0,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """What a cache keeps of ``[..., V]`` teacher logits, on the device; top-k values stay in the teacher's dtype
    (the caller checks their range, then converts them).

    Args:
        logits: ``[..., V]`` in the teacher's dtype (None when the teacher has no head and ``kind`` is None).
        kind: ``"full"``; ``"topk"`` (values sorted descending, int32 ids, fp32 logsumexp at T=1); ``"sampled"``
            (``sample_logits``); anything else keeps nothing.
        top_k: k for ``topk``.
        samples, temperature, generator: N draws at T, for ``sampled``.
    """
    if kind == "full":
        return {"logits/full": logits}
    if kind == "sampled":
        return sample_logits(logits, samples, temperature, generator)
    if kind != "topk":
        return {}
    values, ids = torch.topk(logits, top_k, dim=-1, largest=True, sorted=True)
    # The upcast keeps the logsumexp exact for half-precision teachers (a no-op for fp32 ones).
    lse = torch.logsumexp(logits.float(), dim=-1)
    # The probability mass the k entries keep, per token, in fp32 from the full logits: storage records its
    # mean, 5th percentile and minimum per shard (how lossy top-k is), and stores nothing of it.
    mass = torch.exp(values.float() - lse.unsqueeze(-1)).sum(-1)
    return {"logits/topk_values": values, "logits/topk_ids": ids.to(torch.int32), "logits/lse": lse,
            TOPK_MASS: mass}


def as_logprobs(kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Top-k values as fp32 log-probabilities (values minus the logsumexp), the logsumexp dropped: what a cache
    with ``--topk-values logprob`` keeps (storage quantises them and records the error per shard)."""
    if "logits/lse" not in kept:
        return kept
    out = {k: v for k, v in kept.items() if k != "logits/lse"}
    out["logits/topk_values"] = kept["logits/topk_values"].float() - kept["logits/lse"][..., None]
    return out


def sample_logits(logits: torch.Tensor, samples: int, temperature: float,
                  generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """``samples`` draws with replacement from softmax(logits / T) per token, kept as distinct ids and counts.

    Returns, each ``[..., N]`` (N = ``samples``; the distinct ids first, ascending; unused slots repeat the last id,
    with count 0 and log-probability 0):
    ``logits/sample_ids`` int32, ``logits/sample_counts`` uint8 and ``logits/sample_logp`` float32, the teacher's
    log-probability of each id at T: what the estimator of ``stages.train.losses.sampled_kl`` needs.
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


class ChunkedHead:
    """Top-k logits of a causal LM from its base model's output, ``chunk`` valid tokens at a time.

    Args:
        model: the loaded teacher.
        chunk: valid tokens per chunk; 0 turns chunking off (the full forward computes the logits).
    """

    def __init__(self, model: Any, chunk: int) -> None:
        self.chunk = chunk
        self.head = _head_of(model) if chunk > 0 else None
        self.checked = False

    @property
    def active(self) -> bool:
        return self.head is not None

    def targets(self, last: torch.Tensor, valid: torch.Tensor,
                keep: Callable[[torch.Tensor], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """What ``keep`` makes of each chunk's ``[C, V]`` logits, padded back to ``[B, L, ...]`` (zero at padding).

        Args:
            last: ``[B, L, d]`` the base model's last hidden state.
            valid: ``[B, L]`` bool, the real tokens.
            keep: e.g. ``logit_targets`` with the run's settings bound.
        """
        assert self.head is not None
        where = valid.nonzero(as_tuple=True)  # one host sync; the gather and every scatter reuse it
        parts = [keep(self.head(rows)) for rows in last[where].split(self.chunk)]
        out = {}
        for name in parts[0]:
            flat = torch.cat([p[name] for p in parts])
            padded = torch.zeros((*valid.shape, *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
            padded[where] = flat
            out[name] = padded
        return out

    def agrees(self, full_logits: torch.Tensor, kept: dict[str, torch.Tensor], length: int) -> bool:
        """Whether the chunked result for the batch's first sequence matches the model's own ``[1, L, V]`` logits
        (its logsumexp within 1e-3, 3e-2 in half precision, and its top-1 ids); on disagreement chunking is
        switched off."""
        lse = torch.logsumexp(full_logits[0, :length].float(), dim=-1)
        top1 = full_logits[0, :length].argmax(-1)
        # Half-precision kernels differ between batch shapes, and near-ties then swap a top-1 now and then.
        tolerance, agreement = (1e-3, 0.99) if full_logits.dtype == torch.float32 else (3e-2, 0.9)
        ok = bool(torch.allclose(lse, kept["logits/lse"][0, :length], rtol=tolerance, atol=tolerance)) and bool(
            (top1 == kept["logits/topk_ids"][0, :length, 0]).float().mean() >= agreement)
        self.checked = True
        if not ok:
            self.head = None
        return ok
