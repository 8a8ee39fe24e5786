"""Ctrl-C and SIGTERM during training: finish the optimizer step, save a checkpoint, say how to resume, exit 130/143.

A signal only sets a flag (``stop_on_signal.StopOnSignal``); the loop reads it after each optimizer step, saves a
checkpoint at that boundary (never inside a gradient accumulation, whose partial gradients a checkpoint does not
hold) and raises ``TrainingInterrupted``, which the CLI turns into its message and exit status ``128 + signal``.

This module imports nothing heavy: the CLI imports it to catch ``TrainingInterrupted``. The flag, which agrees
across ranks through torch.distributed, is in ``stop_on_signal``, which only the loop imports.
"""

from __future__ import annotations

import signal


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
