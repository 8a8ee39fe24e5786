"""The devices the fused vocabulary kernel's tests run on: the CPU under Triton's interpreter, where it is on (no
GPU: tests/conftest.py turns it on), or a CUDA device compiled (one mode a process). ``kernel_device`` in
tests/conftest.py is the fixture."""

from __future__ import annotations

import os

import pytest
import torch

DEVICES = ("cpu", "cuda")


def interpreted() -> bool:
    """Whether Triton's kernels run under its interpreter in this process (read when a kernel is defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device(name: str) -> torch.device:
    """``name`` as a device the kernel can run on in this process; a test of another skips, saying why."""
    if name == "cpu" and not interpreted():
        pytest.skip("Triton's interpreter is off in this process (a CUDA device is here: its cases run instead)")
    if name == "cuda" and (interpreted() or not torch.cuda.is_available()):
        pytest.skip("no CUDA device (or Triton's interpreter is on): the CPU cases run the same checks")
    return torch.device(name)


def on_device(s: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of ``s`` on ``device``."""
    return {k: v.to(device) for k, v in s.items()}
