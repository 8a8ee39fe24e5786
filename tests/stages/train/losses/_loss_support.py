"""Shared by the loss tests: a padded mask, the valid positions, padding poisoned with garbage, and the check
that a loss of (student, teacher, mask) is blind to it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # right padding; N_v = 5


def _valid(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


def _poison(x: torch.Tensor, mask: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    """A copy of x with every padded position overwritten (NaN by default)."""
    y = x.detach().clone()
    y[~mask.bool()] = value
    return y


def assert_blind_to_padding(loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                            student: torch.Tensor, teacher: torch.Tensor, rel: float) -> None:
    """``loss`` over NaN in the student's padding and inf in the teacher's equals the clean loss (within ``rel``),
    and its gradient is finite, 0 at every padded position."""
    clean = loss(student, teacher, MASK)
    dirty_s = _poison(student, MASK).requires_grad_(True)
    dirty = loss(dirty_s, _poison(teacher, MASK, float("inf")), MASK)
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item(), rel=rel)
    assert dirty_s.grad is not None and torch.isfinite(dirty_s.grad).all()
    assert torch.all(dirty_s.grad[~MASK.bool()] == 0)
