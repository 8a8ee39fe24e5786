"""The teacher over a run of shards as one continuous pipeline: ``stream_shards(...) -> ShardItems per shard``.

Each batch is taken in (its copy awaited and moved out of pinned memory, its range checked, its sequences cut
out) by a helper thread while this thread queues the next batches on the device, so the forward never waits on
the host. The pipeline does not drain at shard boundaries: a shard of 32,768 tokens is only two batches of
2,048-token rows, and draining after each (the helper's last take and the hand-off to the writers with the device
idle) happened 31 times a run; running on across boundaries took four fp16 layers from 68,265 to 73,053 tokens/s
on an H200 (benchmarks/RESULTS.md, runs 3 and 4). A shard is
handed on as soon as its last batch has been taken in, with the next shard's batches already queued.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kdcache.stages.precompute.adapters import Capture
from kdcache.stages.precompute.capture.transfer import ShardItems
from kdcache.stages.precompute.core.options import IN_FLIGHT
from kdcache.stages.precompute.core.progress import Progress, RunStats
from kdcache.stages.precompute.core.teacher_id import Teacher
from kdcache.stages.precompute.rows.batching import collate, plan_batches
from kdcache.stages.precompute.rows.data import TokenStreams
from kdcache.storage import ArrayKind, Lease, kind_of, prefixed, split_stream


@dataclass
class _Shard:
    """One shard's inputs, and its per-sequence results as their batches are taken in."""

    ids: dict[str, Sequence[np.ndarray]]
    tokens: dict[str, Sequence[np.ndarray]]
    items: list[dict[str, np.ndarray] | None]
    left: int = 0  # batches not yet taken in
    finite: list[frozenset[str]] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)  # the batches' reused buffers, released once written

    @classmethod
    def of(cls, data: TokenStreams, bounds: tuple[int, int]) -> _Shard:
        start, stop = bounds
        ids = {stream: seqs[start:stop] for stream, seqs in data.ids.items()}
        tokens = {name: seqs[start:stop] for name, seqs in data.tokens.items()}
        return cls(ids, tokens, [None] * (stop - start))

    def result(self) -> ShardItems:
        """Every sequence's dict in data order; ``finite``: the float targets finite in every batch."""
        return ShardItems(self.items, finite=frozenset.intersection(*self.finite)  # type: ignore[arg-type]
                          if self.finite else frozenset(), leases=self.leases)


def stream_shards(capture: Capture, teacher: Teacher, data: TokenStreams, bounds: Iterable[tuple[int, int]],
                  batch_size: int, stats: RunStats, progress: Progress) -> Generator[ShardItems, None, None]:
    """Run the teacher over each shard's sequences in batches of at most ``batch_size`` sequences, bucketed by the
    first stream's lengths; yield the shards in order.

    At most ``IN_FLIGHT`` batches are queued ahead of the helper thread, which bounds the device's and the pinned
    memory they hold; an error found there (an fp16 overflow) is raised here before its shard is yielded.

    Yields:
        per shard, one dict per sequence in data order: every stream's ``input_ids [L]`` and token arrays
        (``loss_mask``, ``position_ids``), plus every target; ``finite`` names the float targets the device found
        finite in every batch.
    """
    queued: deque[tuple[_Shard, np.ndarray, Future[ShardItems]]] = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="kdcache-take") as taker:
        for shard in (_Shard.of(data, b) for b in bounds):
            first = next(iter(shard.ids.values()))
            batches = plan_batches(np.array([len(s) for s in first]), batch_size)
            shard.left = len(batches)
            for batch in batches:
                started = time.perf_counter()
                pending = capture(*_device_batch(teacher, shard.ids, shard.tokens, batch))
                stats.forward_seconds += time.perf_counter() - started
                stats.tokens += sum(len(seqs[i]) for seqs in shard.ids.values() for i in batch)
                queued.append((shard, batch, taker.submit(pending)))
                while len(queued) > IN_FLIGHT:
                    yield from _place(*queued.popleft(), stats, progress)
        while queued:
            yield from _place(*queued.popleft(), stats, progress)


def compute_shard(capture: Capture, teacher: Teacher, data: TokenStreams, bounds: tuple[int, int],
                  batch_size: int, stats: RunStats, progress: Progress) -> ShardItems:
    """One shard on its own (``stream_shards`` of one): the estimate's and the projection fit's unit."""
    with closing(stream_shards(capture, teacher, data, [bounds], batch_size, stats, progress)) as shards:
        return next(shards)  # closed here: its helper thread ends now, not when the generator is collected


def _place(shard: _Shard, batch: np.ndarray, taken: Future[ShardItems], stats: RunStats,
           progress: Progress) -> Iterator[ShardItems]:
    """Put a taken-in batch's sequences into their shard; yield the shard when it was its last batch."""
    waited = time.perf_counter()
    output = taken.result()
    stats.forward_seconds += time.perf_counter() - waited  # the device's (or the helper's) time waited for
    stats.take_seconds += getattr(output, "host_seconds", 0.0)
    shard.finite.append(output.finite)
    shard.leases.extend(getattr(output, "leases", ()))
    for i, item in zip(batch, output):
        item.update({prefixed(stream, "input_ids"): seqs[i] for stream, seqs in shard.ids.items()})
        item.update({name: seqs[i] for name, seqs in shard.tokens.items()})
        shard.items[i] = item
    stats.sequences += len(batch)
    progress.update(len(batch))
    shard.left -= 1
    if shard.left == 0:
        yield shard.result()


def _device_batch(teacher: Teacher, ids: Mapping[str, Sequence[np.ndarray]],
                  tokens: Mapping[str, Sequence[np.ndarray]],
                  batch: np.ndarray) -> tuple[Any, dict[str, list[int]], Any]:
    """One batch's padded ids and masks per stream, lengths, and restarting positions, on the teacher's device
    (copied from pinned memory without blocking where it is a GPU)."""
    pad_id = teacher.tokenizer.pad_token_id if teacher.tokenizer.pad_token_id is not None else 0
    cuda = teacher.device.type == "cuda"

    def on_device(a: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(a)
        return host.pin_memory().to(teacher.device, non_blocking=True) if cuda else host.to(teacher.device)

    padded = {stream: tuple(on_device(a) for a in collate([seqs[i] for i in batch], pad_id))
              for stream, seqs in ids.items()}
    positions = {split_stream(name)[0]: on_device(collate([seqs[i] for i in batch], 0)[0])
                 for name, seqs in tokens.items() if kind_of(name) == ArrayKind.POSITION_IDS}
    lengths = {stream: [len(seqs[i]) for i in batch] for stream, seqs in ids.items()}
    return padded, lengths, positions
