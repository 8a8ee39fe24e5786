"""Shared by the loss tests: a padded mask, the valid positions, and padding poisoned with garbage."""

from __future__ import annotations

import torch

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # right padding; N_v = 5


def _valid(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


def _poison(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """A copy of x with every padded position overwritten (NaN by default)."""
    y = x.detach().clone()
    y[~mask.bool()] = value
    return y
