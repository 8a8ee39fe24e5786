"""Micro-batches on the device one step ahead: the copy and decode of batch i+1 run beside step i.

The stream hands batches over in pinned host memory. Copied at the start of their own step, the copy (134 MB per
micro-batch of 8,192 tokens with four fp16 hidden layers of width 2,048: about 5 ms at 25 GB/s) and the decode of
coded targets sat on the compute stream ahead of the forward, where nothing overlaps them. ``DeviceFeed`` queues
batch i+1's copy and decode on a side CUDA stream before step i's kernels are queued, so they run beside step i;
the compute stream waits for the side stream on the device (no host wait) before it uses the batch. Tensors made
on the side stream are marked as used by the compute stream (``record_stream``), so the caching allocator does not
hand their memory to the next batch while the step still reads them. One more batch is held on the device.

On the CPU there is no stream and nothing to overlap: by default each batch is prepared as it is handed over, the
same values in the same order (``ahead=True`` keeps the GPU's order, for the tests). Preparing it a step ahead
there only held one more batch, and with dense ``[B, L, V]`` teacher logits that batch is 0.5 GiB at 8 x 256
tokens and V = 128k (issue 63).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from kdcache.stages.train.feed.streaming import Batch


class DeviceFeed:
    """Iterates ``prepare(batch)`` for each host batch, the next one prepared while the current one is used.

    Args:
        batches: host batches (the stream's DataLoader).
        prepare: host batch -> device batch (``streaming.to_device`` with the cache's decode).
        device: where the step runs; a CUDA device gets the side stream.
        ahead: prepare the next batch before handing over this one (default: where there is a side stream).

    Attributes:
        waited: seconds spent waiting for host batches (the reader was behind).
    """

    def __init__(self, batches: Iterable[Batch], prepare: Callable[[Batch], Batch], device: torch.device,
                 ahead: bool | None = None) -> None:
        self.batches, self.prepare = batches, prepare
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead = self.stream is not None if ahead is None else ahead
        self.waited = 0.0

    def __iter__(self) -> Iterator[Batch]:
        host = iter(self.batches)
        if not self.ahead:
            while (batch := self._start(host)) is not None:
                yield self._hand_over(batch)
            return
        ahead = self._start(host)
        while ahead is not None:
            current = self._hand_over(ahead)
            ahead = self._start(host)  # queued before the consumer queues step i's kernels
            yield current

    def _start(self, host: Iterator[Batch]) -> Batch | None:
        """The next host batch's copy and decode, queued (on the side stream where there is one)."""
        asked = time.perf_counter()
        batch = next(host, None)
        self.waited += time.perf_counter() - asked
        if batch is None:
            return None
        if self.stream is None:
            return self.prepare(batch)
        # After what the compute stream has queued so far (the previous step): tensors made there are complete.
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            return self.prepare(batch)

    def _hand_over(self, batch: Batch) -> Batch:
        """The compute stream waits (on the device) for the batch's side-stream work and owns its tensors."""
        if self.stream is not None:
            compute = torch.cuda.current_stream(self.stream.device)
            compute.wait_stream(self.stream)
            for value in batch.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(compute)
        return batch
