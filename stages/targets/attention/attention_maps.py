"""A student's attention maps as the distribution it attends with: the probabilities *before* attention dropout.

Hugging Face's eager attention returns the matrix it multiplies the values by, which in training mode is
``dropout(softmax(scores))``: a tenth of its entries zero and the rest scaled by ``1 / (1 - p)``. A KL against a
teacher's distribution on that matrix measures the dropout, not the attention (about 6x too large with p = 0.1).
``MAPS_ATTENTION`` is an attention implementation that runs the model's own eager attention unchanged (dropout
still acts on the output, so training regularizes as before) but returns the softmax it computed before dropout.

It is a transformers 5 attention implementation: every model calls
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)``, so one
registration covers every architecture whose modeling module defines ``eager_attention_forward`` (BERT/MiniLM,
GPT-2, Llama, BART, T5, ...), self- and cross-attention alike. The softmax is taken with a
``TorchFunctionMode`` scoped to that one call, so nothing outside the attention kernel is watched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MAPS_ATTENTION = "kdcache_maps"
_SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax)


class AttentionMapsError(RuntimeError):
    """A model's attention cannot return its pre-dropout probabilities (caught and worded by callers)."""


class _LastSoftmax(TorchFunctionMode):
    """Keeps the output of the last softmax run inside the ``with`` block (the attention probabilities)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: torch.Tensor | None = None

    def __torch_function__(self, func: Callable[..., Any], types: object, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in _SOFTMAX:
            self.last = out
        return out


def maps_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's eager attention; returns ``(output [B, L, H, d], probabilities [B, H, L, L_k])``.

    The output is the eager one (with dropout in training mode); the probabilities are its softmax before
    dropout, in the dtype eager returns its weights in, with their gradient.
    """
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise AttentionMapsError(f"{type(module).__name__} has no eager attention to return maps from")
    with _LastSoftmax() as seen:
        output, weights = eager(module, query, key, value, attention_mask, **kwargs)
    probs = seen.last
    if weights is None or probs is None or probs.shape != weights.shape:
        # A softmax over more columns than the weights (attention sinks) or none at all: not a plain map.
        raise AttentionMapsError(f"{type(module).__name__}'s eager attention does not return softmax(scores) "
                                 f"as its weights, so its pre-dropout maps cannot be taken")
    return output, probs.to(weights.dtype)


def register_maps_attention() -> None:
    """Register ``MAPS_ATTENTION`` with transformers (its function, and eager's additive mask format)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(MAPS_ATTENTION, maps_attention_forward)
    AttentionMaskInterface.register(MAPS_ATTENTION, eager_mask)


def use_maps_attention(model: torch.nn.Module) -> None:
    """Make ``model`` return pre-dropout attention maps under ``output_attentions=True``."""
    register_maps_attention()
    model.set_attn_implementation(MAPS_ATTENTION)  # type: ignore[operator]
