"""Ctrl-C and SIGTERM during training: finish the optimizer step, save a checkpoint, say how to resume, exit 130/143.

A signal only sets a flag (``StopOnSignal``); the loop reads it after each optimizer step, saves a checkpoint at
that boundary (never inside a gradient accumulation, whose partial gradients a checkpoint does not hold) and
raises ``TrainingInterrupted``, which the CLI turns into its message and exit status ``128 + signal``. A second
signal, sent more than ``DUPLICATE_WINDOW`` seconds after the first, stops at once (``KeyboardInterrupt``), for a
user who will not wait for the save; one arriving with the first is the same request delivered twice.

Several ranks agree before stopping: a signal may reach one rank a step before another, and a checkpoint is a
collective, so each optimizer step all-reduces the flag (one integer; only when ``world_size > 1``).

This module imports nothing heavy: the CLI imports it to catch ``TrainingInterrupted``.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_WINDOW = 2.0  # seconds within which a second signal is the same request delivered twice


class TrainingInterrupted(Exception):
    """Training stopped on a signal after saving a checkpoint at optimizer step ``step`` in ``run_dir``."""

    def __init__(self, signum: int, step: int, run_dir: str) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")
        self.signum, self.step, self.run_dir = signum, step, run_dir

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def message(self) -> str:
        """What the user reads: where the work is kept and how to continue it."""
        return (f"interrupted by {signal.Signals(self.signum).name}; step {self.step} is saved in "
                f"{self.run_dir}/checkpoints. Continue it with the same command plus --resume")


class StopOnSignal:
    """``with StopOnSignal(world_size, announce) as stop:`` SIGINT and SIGTERM set ``stop.signum`` instead of
    ending the process; ``stop.requested()`` says, after an optimizer step, whether every rank should stop now.

    Outside the main thread (a test calling the loop from a thread) signals cannot be caught and nothing changes.
    """

    def __init__(self, world_size: int = 1, announce: bool = True) -> None:
        self.world_size, self.announce = world_size, announce
        self.signum, self._first = 0, 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum:
            # A signal sent to the process and to its group (a launcher, `timeout`, Ctrl-C under a parent) arrives
            # twice at once: only one sent later says "stop now, without the checkpoint".
            if time.monotonic() - self._first > DUPLICATE_WINDOW:
                raise KeyboardInterrupt
            return
        self.signum, self._first = signum, time.monotonic()
        if self.announce:
            print(f"kdcache train: {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """Whether to stop after this optimizer step: a signal arrived here, or (several ranks) on any rank."""
        if self.world_size <= 1:
            return bool(self.signum)
        import torch
        import torch.distributed as dist

        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return bool(self.signum)
