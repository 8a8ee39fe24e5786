"""Teacher logits through the LM head in chunks of valid tokens, never as one ``[B, L, V]`` tensor.

A causal LM's forward computes logits for every position of the padded batch, and the logsumexp upcasts all of
it to fp32: at V = 128k, B = 8, L = 2,048 that is 8 GB of fp32 on the teacher's device, for padding included.
Here the base model runs alone, the valid rows of its last hidden state are gathered (``[N_v, d]``), and the
head maps ``chunk`` rows at a time to logits, of which only what the run's logit kind captures is kept (its
``capture_chunk`` says whether it chunks at all: top-k and sampled do, full logits are stored whole anyway).
Peak memory for logits is then ``chunk · V`` (plus its fp32 copy), whatever the batch.

The head is the model's output embedding (with Gemma-style soft-capping or Cohere-style scaling where the config
has them). Because a model may do more between its base and its logits, the first batch is checked against the
model's own forward on its first sequence; on any disagreement the run falls back to the full forward, and says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kdcache.stages.precompute.core.targets import CAUSAL_SUFFIXES
from kdcache.stages.targets.logits import LogitSettings
from kdcache.stages.targets.logits.teacher_head import finish_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _head_of(model: PreTrainedModel) -> Callable[[torch.Tensor], torch.Tensor] | None:
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


def logit_targets(logits: torch.Tensor | None, settings: LogitSettings,
                  generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """What the run's logit kind keeps of ``[..., V]`` teacher logits, on the device (nothing without a mode).

    Args:
        logits: ``[..., V]`` in the teacher's dtype (None when the teacher has no head and keeps no logits).
        settings: the run's logit mode and its fields (``Targets.logit``: top-k, draws, temperature, log-prob step).
        generator: seeded, for a kind that draws (``LogitKind.draws``).
    """
    if logits is None or settings.kind is None:
        return {}
    return settings.kind.capture(logits, settings, generator)


def head_probe(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """What ``ChunkedHead.agrees`` compares of ``[..., V]`` logits: the fp32 logsumexp and the top-1 id."""
    return {"logits/lse": torch.logsumexp(logits.float(), dim=-1), "logits/top1": logits.argmax(-1)}


class ChunkedHead:
    """Top-k logits of a causal LM from its base model's output, ``chunk`` valid tokens at a time.

    Args:
        model: the loaded teacher.
        chunk: valid tokens per chunk; 0 turns chunking off (the full forward computes the logits).
    """

    def __init__(self, model: PreTrainedModel, chunk: int) -> None:
        self.chunk = chunk
        self.head = _head_of(model) if chunk > 0 else None
        self.checked = False

    @property
    def active(self) -> bool:
        return self.head is not None

    def targets(self, last: torch.Tensor, valid: torch.Tensor, keep: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                rows: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """What ``keep`` makes of each chunk's ``[C, V]`` logits, padded back to ``[B, L, ...]`` (zero at padding).

        Args:
            last: ``[B, L, d]`` the base model's last hidden state.
            valid: ``[B, L]`` bool, the real tokens.
            keep: e.g. ``logit_targets`` with the run's settings bound, or ``head_probe``.
            rows: ``[N_v]`` flat row numbers of the valid tokens (``transfer.valid_rows``), on the device; when
                the caller knows the lengths this saves the host sync of finding them in ``valid``.
        """
        assert self.head is not None
        if rows is None:
            rows = valid.flatten().nonzero().flatten()  # one host sync
        flat_last = last.flatten(0, 1).index_select(0, rows)
        parts = [self._kept(chunk, keep) for chunk in flat_last.split(self.chunk)]
        out = {}
        for name in parts[0]:
            flat = torch.cat([p[name] for p in parts])
            padded = torch.zeros((valid.numel(), *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
            out[name] = padded.index_copy_(0, rows, flat).view(*valid.shape, *flat.shape[1:])
        return out

    def _kept(self, chunk: torch.Tensor, keep: Callable[[torch.Tensor], dict[str, torch.Tensor]]
              ) -> dict[str, torch.Tensor]:
        """What ``keep`` makes of one ``[C, d]`` chunk's ``[C, V]`` logits."""
        assert self.head is not None
        return keep(self.head(chunk))

    def probe(self, last: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """``head_probe`` of the chunked logits (``[B, L]`` logsumexp and top-1), for ``agrees``."""
        return self.targets(last, valid, head_probe)

    def agrees(self, full_logits: torch.Tensor, kept: dict[str, torch.Tensor], length: int) -> bool:
        """Whether the chunked result for the batch's first sequence matches the model's own ``[1, L, V]`` logits
        (its logsumexp within 1e-3, 3e-2 in half precision, and its top-1 ids); on disagreement chunking is
        switched off."""
        lse = torch.logsumexp(full_logits[0, :length].float(), dim=-1)
        top1 = full_logits[0, :length].argmax(-1)
        # Half-precision kernels differ between batch shapes, and near-ties then swap a top-1 now and then.
        tolerance, agreement = (1e-3, 0.99) if full_logits.dtype == torch.float32 else (3e-2, 0.9)
        ok = bool(torch.allclose(lse, kept["logits/lse"][0, :length], rtol=tolerance, atol=tolerance)) and bool(
            (top1 == kept["logits/top1"][0, :length]).float().mean() >= agreement)
        self.checked = True
        if not ok:
            self.head = None
        return ok
