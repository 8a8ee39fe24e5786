"""The flag a signal sets during training (``StopOnSignal``), read by the loop after each optimizer step.

A second signal, sent more than ``DUPLICATE_WINDOW`` seconds after the first, stops at once (``KeyboardInterrupt``),
for a user who will not wait for the save; one arriving with the first is the same request delivered twice.

Several ranks agree before stopping: a signal may reach one rank a step before another, and a checkpoint is a
collective, so each optimizer step all-reduces the flag (one integer; only when ``world_size > 1``). That needs
torch.distributed, so this is apart from ``interrupt`` (which the CLI imports): only the training loop imports it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DUPLICATE_WINDOW = 2.0  # seconds within which a second signal is the same request delivered twice


class StopOnSignal:
    """``with StopOnSignal(world_size, announce) as stop:`` SIGINT and SIGTERM set ``stop.signum`` instead of
    ending the process; ``stop.requested()`` says, after an optimizer step, whether every rank should stop now.

    Outside the main thread (a test calling the loop from a thread) signals cannot be caught and nothing changes.
    """

    def __init__(self, world_size: int = 1, announce: bool = True, speaker: str = "kdcache train") -> None:
        self.world_size, self.announce, self.speaker = world_size, announce, speaker
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
            print(f"{self.speaker}: {signal.Signals(signum).name}: finishing this step and saving a checkpoint "
                  f"(send it again to stop at once)", file=sys.stderr, flush=True)

    def requested(self) -> bool:
        """Whether to stop after this optimizer step: a signal arrived here, or (several ranks) on any rank."""
        if self.world_size <= 1:
            return bool(self.signum)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return bool(self.signum)
