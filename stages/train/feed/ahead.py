"""How far ahead of the step the stream's producer runs: a queue bounded in batches and in bytes.

A micro-batch of top-k targets or a few hidden layers is a few MiB to ~130 MiB, and ``--prefetch 4`` of them
ahead cost little. One of dense teacher logits is ``B x L x V`` fp16: 501 MiB at 8 x 256 tokens and V = 128,256,
so the same four (and the one the producer held while it waited for room) were 2.5 GiB of host memory that buys
no speed once one batch is ready (issue 63). ``ByteQueue`` keeps the count bound as it was and adds a byte budget:
the producer starts assembling a batch only while the batches queued and one more of the last one's size fit in
``budget`` bytes, or nothing is queued (a batch bigger than the budget still goes, one at a time). What is read
and in which order never changes; only how many batches wait.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import torch

PREFETCH_MIB = 512  # the default byte budget: four batches of up to 128 MiB queue as before; dense logits, one


def batch_bytes(batch: dict[str, Any]) -> int:
    """Bytes of a host batch's tensors (what it holds while it waits in the queue)."""
    return sum(v.numel() * v.element_size() for v in batch.values() if isinstance(v, torch.Tensor))


class ByteQueue:
    """A FIFO from one producer thread to one consumer, at most ``items`` batches and about ``budget`` bytes.

    The producer asks ``room(stop)`` before it assembles a batch and ``put(item, size, stop)`` after; the
    consumer ``get``s. Bytes are counted from ``put`` to ``get``: a batch the consumer holds is its own.
    """

    def __init__(self, items: int, budget: int) -> None:
        self.items, self.budget = max(1, items), budget
        self._held: deque[tuple[object, int]] = deque()
        self._bytes = 0
        self._last = 0  # the size of the last batch put: the estimate of the next one
        self._changed = threading.Condition()

    @property
    def queued_bytes(self) -> int:
        with self._changed:
            return self._bytes

    def room(self, stop: threading.Event) -> bool:
        """Wait until one more batch of the last one's size fits the byte budget or nothing is queued, so that
        the batch the producer is about to assemble counts too. False: ``stop`` was set while waiting."""
        with self._changed:
            while self._held and self._bytes + self._last > self.budget and not stop.is_set():
                self._changed.wait(0.1)
        return not stop.is_set()

    def put(self, item: object, size: int, stop: threading.Event) -> bool:
        """Queue ``item`` of ``size`` bytes once fewer than ``items`` wait (the count bound, as a
        ``queue.Queue(items)``); 0 bytes for the end marker or an error. False: ``stop`` was set while waiting."""
        with self._changed:
            while len(self._held) >= self.items and not stop.is_set():
                self._changed.wait(0.1)
            if stop.is_set():
                return False
            self._held.append((item, size))
            self._bytes += size
            self._last = size or self._last
            self._changed.notify_all()
        return True

    def get(self) -> object:
        """The oldest item, waiting for one."""
        with self._changed:
            while not self._held:
                self._changed.wait()
            item, size = self._held.popleft()
            self._bytes -= size
            self._changed.notify_all()
        return item
