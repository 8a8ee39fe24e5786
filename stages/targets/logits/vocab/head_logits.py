"""Student logits that are never materialised: the last hidden state and the LM head, applied chunk by chunk.

A vocabulary loss needs ``[N_v, V]`` logits, but only one chunk of them at a time. ``HeadLogits`` stands for the
student's ``[B, L, V]`` logits as ``hidden [B, L, d] @ weight [V, d]ᵀ (+ bias [V])``; the losses select its
valid rows (``select``: ``HeadRows [N_v, d]``) and ``vocab_pass`` applies the head to one chunk of rows at a time
for every vocabulary term of the step together (``vocab_pass.HeadPass``: the chunk's gradient is taken in the
forward pass and its logits dropped, liger-kernel's way), so the chunk's ``[C, V]`` logits exist only while that
chunk is evaluated: peak memory ∝ C × V, whatever B × L.

On a CUDA device with ``liger-kernel`` installed (the optional extra ``kdcache[gpu]``), cross-entropy as the only
vocabulary term goes through its fused linear cross-entropy kernel instead (``fused_ce_sum``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

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

    def logits(self) -> torch.Tensor:
        """``[N, V]`` in the head's dtype (a bf16 head gives bf16 logits, as the model's own forward does)."""
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)

    def on_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``[N, k]`` float32: the logits at ``ids [N, k]`` only, chunk by chunk, never the full ``[N, V]``
        (``IdsLogits``)."""
        if not ids.shape[0]:
            return self.hidden.new_zeros((0, ids.shape[1]), dtype=torch.float32)
        return IdsLogits.apply(self.hidden, self.weight, self.bias, ids)


class IdsLogits(torch.autograd.Function):
    """``z [N, k] = hidden [N, d] · weight[ids] [N, k, d] (+ bias[ids])`` in float32, ``IDS_CHUNK`` rows at a time.

    Autograd's own backward of ``weight[ids]`` builds a dense ``[V, d]`` gradient for every chunk (at V = 128k,
    d = 2,048: 512 MiB written and added per 64 rows). Here the backward adds every chunk's rows into one float32
    ``[V, d]`` accumulator with ``index_add_``, and nothing is kept from the forward pass but its inputs.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                ids: torch.Tensor) -> torch.Tensor:
        parts = []
        for h, i in zip(hidden.split(IDS_CHUNK), ids.split(IDS_CHUNK)):
            z = torch.einsum("cd,ckd->ck", h, weight[i])
            parts.append((z if bias is None else z + bias[i]).float())
        ctx.save_for_backward(hidden, weight, ids)
        ctx.has_bias = bias is not None
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, ids = ctx.saved_tensors
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        start = 0
        for h, i, g in zip(hidden.split(IDS_CHUNK), ids.split(IDS_CHUNK), grad.split(IDS_CHUNK)):
            if grad_h is not None:
                grad_h[start:start + len(h)] = torch.einsum("ck,ckd->cd", g.to(weight.dtype), weight[i])
            if grad_w is not None:  # row ids[c, j] gains grad[c, j] * hidden[c]
                grad_w.index_add_(0, i.reshape(-1), (g[..., None] * h.float()[:, None, :]).reshape(-1, h.shape[1]))
            if grad_b is not None:
                grad_b.index_add_(0, i.reshape(-1), g.reshape(-1))
            start += len(h)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype), None)


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


def fused_ce_available(device: torch.device) -> bool:
    """Whether cross-entropy runs in liger-kernel's fused linear cross-entropy here (CUDA + liger-kernel)."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def fused_ce_sum(rows: HeadRows, labels: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of the rows' logits against ``labels [N]`` through liger-kernel (CUDA only)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(rows.hidden, rows.weight, labels, bias=rows.bias, reduction="sum").float()
