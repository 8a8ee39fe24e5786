"""Student logits that are never materialised: the last hidden state and the LM head, applied chunk by chunk.

A vocabulary loss needs ``[N_v, V]`` logits, but only one chunk of them at a time. ``HeadLogits`` stands for the
student's ``[B, L, V]`` logits as ``hidden [B, L, d] @ weight [V, d]ᵀ (+ bias [V])``; the losses select its
valid rows (``select``: ``HeadRows [N_v, d]``) and ``loss_rows.chunked_sum`` applies the head to one chunk of rows
at a time (``HeadSum``: the chunk's gradient is taken in the forward pass and its logits dropped, liger-kernel's
way; rows that need a gradient of their own go through activation checkpointing instead, recomputed in backward),
so the chunk's ``[C, V]`` logits exist only while that chunk is summed: peak memory ∝ C × V, whatever B × L.

On a CUDA device with ``liger-kernel`` installed (the optional extra ``kdcache[gpu]``), cross-entropy goes through
its fused linear cross-entropy kernel instead (``fused_ce_sum``); every other term uses the chunks above.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
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

    def with_hidden(self, hidden: torch.Tensor) -> HeadRows:
        return HeadRows(hidden, self.weight, self.bias)

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


Rows = torch.Tensor | HeadRows  # [N, V] logits, or what builds them


class HeadSum(torch.autograd.Function):
    """``Σ fn(chunk's [C, V] logits, *chunk's rows)`` over chunks of ``hidden [N, d]``, each chunk's gradient taken in
    the forward pass (liger-kernel's way): the chunk's logits live only while it is summed, the backward pass only
    scales the stored ``[N, d]`` and ``[V, d]`` gradients. Three matmuls per chunk, as for materialised logits (a
    recomputing checkpoint needs four). The other rows are targets: they take no gradient."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                fn: Callable[..., torch.Tensor], chunk: int, *rows: torch.Tensor) -> torch.Tensor:
        grad_h = torch.zeros_like(hidden)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)  # fp32: summed over every chunk
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            h, part = hidden[start:start + chunk], [r[start:start + chunk] for r in rows]
            with torch.enable_grad():
                z = torch.nn.functional.linear(h, weight, bias).detach().requires_grad_(True)
                value = fn(z, *part)
                (dz,) = torch.autograd.grad(value, z)
            grad_h[start:start + chunk] = dz @ weight
            grad_w += dz.t() @ h
            if grad_b is not None:
                grad_b += dz.float().sum(0)
            total += value.detach().float()
        ctx.save_for_backward(grad_h, grad_w, *(() if grad_b is None else (grad_b,)))
        ctx.weight_dtype, ctx.extra = weight.dtype, len(rows)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w, *grad_b = ctx.saved_tensors
        bias = (grad_b[0] * grad).to(ctx.weight_dtype) if grad_b else None
        return (grad_h * grad.to(grad_h.dtype), (grad_w * grad).to(ctx.weight_dtype), bias, None, None,
                *(None,) * ctx.extra)


def head_sum(fn: Callable[..., torch.Tensor], rows: HeadRows, others: Sequence[torch.Tensor],
             chunk: int) -> torch.Tensor:
    """``Σ fn(logits, *others)`` in chunks of ``chunk`` rows through ``HeadSum`` (no gradient wanted: a plain loop)."""
    wants_grad = torch.is_grad_enabled() and (rows.hidden.requires_grad or rows.weight.requires_grad)
    if not wants_grad:
        with torch.no_grad():
            return sum((fn(rows.with_hidden(h).logits(), *o).float()
                        for h, *o in zip(rows.hidden.split(chunk), *(r.split(chunk) for r in others))),
                       rows.hidden.new_zeros((), dtype=torch.float32))
    return HeadSum.apply(rows.hidden, rows.weight, rows.bias, fn, chunk, *others)


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
                "the LM head (pure torch)")
    return "chunked: every vocabulary term in chunks of the LM head, [B, L, V] never built (pure torch)"
