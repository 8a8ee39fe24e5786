"""Student logits that are never materialised: the last hidden state and the LM head, applied chunk by chunk.

A vocabulary loss needs ``[N_v, V]`` logits, but only one chunk of them at a time. ``HeadLogits`` stands for the
student's ``[B, L, V]`` logits as ``hidden [B, L, d] @ weight [V, d]ᵀ (+ bias [V])``; the losses select its
valid rows (``select``: ``HeadRows [N_v, d]``) and ``loss_rows.chunked_sum`` applies the head to one chunk of rows
inside activation checkpointing, so the chunk's ``[C, V]`` logits exist only while that chunk is summed and are
recomputed in the backward pass: peak memory ∝ C × V, whatever B × L.

On a CUDA device with ``liger-kernel`` installed (the optional extra ``kdcache[gpu]``), cross-entropy goes through
its fused linear cross-entropy kernel instead (``fused_ce_sum``); every other term uses the chunks above.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from kdcache.stages.common.loss_errors import LossError

IDS_CHUNK = 64  # rows per chunk of a gather of k logits: [64, k, d] gathered head rows (k=128, d=2,048: 32 MiB bf16)


@dataclass(frozen=True)
class HeadRows:
    """Logit rows ``[N, V]`` as ``hidden [N, d]`` and the head; ``logits()`` builds them (call it on a chunk)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.hidden.shape[0], self.weight.shape[0]))

    def with_hidden(self, hidden: torch.Tensor) -> HeadRows:
        return HeadRows(hidden, self.weight, self.bias)

    def logits(self) -> torch.Tensor:
        """``[N, V]`` in the head's dtype (a bf16 head gives bf16 logits, as the model's own forward does)."""
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)

    def on_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N, k]`` float32: the logits at ``ids [N, k]`` only, chunk by chunk, never the full ``[N, V]``."""
        parts = [checkpoint(self._on_ids, h, i, use_reentrant=False)
                 for h, i in zip(self.hidden.split(IDS_CHUNK), ids.split(IDS_CHUNK))]
        return torch.cat(parts) if parts else self.hidden.new_zeros((0, ids.shape[1]), dtype=torch.float32)

    def _on_ids(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("cd,ckd->ck", hidden, self.weight[ids])
        return (z if self.bias is None else z + self.bias[ids]).float()


@dataclass(frozen=True)
class HeadLogits:
    """The student's logits ``[B, L, V]`` as ``hidden [B, L, d]`` and its LM head (``weight [V, d]``, ``bias``)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3 or self.hidden.shape[-1] != self.weight.shape[-1]:
            raise LossError(f"the student's last hidden state {tuple(self.hidden.shape)} does not fit its LM head "
                            f"{tuple(self.weight.shape)}; expected [B, L, d] and [V, d]")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden.shape[:2], self.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def select(self, mask: torch.Tensor) -> HeadRows:
        """The rows at ``mask [B, L]`` (bool), in batch-major order: ``HeadRows [N_v, d]``."""
        return HeadRows(self.hidden[mask], self.weight, self.bias)


Rows = torch.Tensor | HeadRows  # [N, V] logits, or what builds them


def split_rows(rows: Rows, size: int) -> tuple[torch.Tensor, ...]:
    """The tensors a chunked sum splits: the logits themselves, or the hidden rows behind them."""
    return (rows.hidden if isinstance(rows, HeadRows) else rows).split(size)


def chunk_builder(rows: Rows) -> Callable[[torch.Tensor], torch.Tensor]:
    """How one chunk of ``split_rows(rows)`` becomes ``[C, V]`` logits (the identity for logits themselves)."""
    if isinstance(rows, HeadRows):
        return lambda hidden: rows.with_hidden(hidden).logits()
    return lambda chunk: chunk


def fused_ce_available(device: torch.device) -> bool:
    """Whether cross-entropy runs in liger-kernel's fused linear cross-entropy here (CUDA + liger-kernel)."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def fused_ce_sum(rows: HeadRows, labels: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of the rows' logits against ``labels [N]`` through liger-kernel (CUDA only)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(rows.hidden, rows.weight, labels, bias=rows.bias, reduction="sum").float()


def vocab_path(device: torch.device) -> str:
    """The path the vocabulary losses take from the last hidden state, in words (train's first lines say it)."""
    if fused_ce_available(device):
        return ("fused: cross-entropy in liger-kernel's fused linear cross-entropy, the KL terms in chunks of "
                "the LM head recomputed in backward")
    return "chunked: every vocabulary term in chunks of the LM head recomputed in backward (pure torch)"
