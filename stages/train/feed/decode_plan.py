"""Which shards the training stream decodes ahead of each micro-batch, and when it lets them go.

A pure plan over the epochs' micro-batches (``decode_plan``); the stream's producer thread carries it out. The
rules:

- a shard starts decoding when one of the next ``prefetch`` micro-batches needs it (and, from an object store,
  when it is among the next ``readahead`` shards in order of first use);
- within an epoch a shard is decoded once and let go after its last use there (block shuffling keeps the number
  held at once near a shuffle block's shards);
- **the window runs on across epoch boundaries**: the last micro-batches of an epoch already start the decodes of
  the next epoch's first ones, and a shard still held that the next epoch's window asks for is kept, not decoded
  again. Seeing one epoch at a time, the producer began every epoch with all its first shards cold while the
  step emptied the queue: the GPU run of issue 31 lost 3x tokens/s in the interval holding each epoch boundary of
  a small cache (one shuffle block spans it, so the first micro-batches need most of its shards).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

Locate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]  # global ids [B] -> (shard [B], index in shard [B])


def shard_locator(shard_ranges: Sequence[tuple[int, int]]) -> Locate:
    """``Locate`` for shards holding consecutive ``(seq_start, seq_stop)`` ranges, in that order."""
    starts = np.array([a for a, _ in shard_ranges], dtype=np.int64)

    def locate(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(starts, ids, side="right") - 1
        return shard, ids - starts[shard]
    return locate


@dataclass(frozen=True)
class PlannedBatch:
    """One micro-batch and the decodes around it.

    Attributes:
        epoch, step: where it stands in the stream.
        ids: ``[B]`` global sequence ids.
        shards: ``[B]`` each sequence's shard (a position in the stream's shard list).
        local: ``[B]`` each sequence's index within its shard.
        decode: shards to start decoding before this batch is assembled (for it or for the next ones), in
            order of need.
        release: shards to let go once it is assembled.
    """

    epoch: int
    step: int
    ids: np.ndarray
    shards: np.ndarray
    local: np.ndarray
    decode: tuple[int, ...]
    release: tuple[int, ...]


class _Epoch:
    """One epoch's micro-batches, located, with each shard's last use and the order of first uses."""

    def __init__(self, epoch: int, items: list[tuple[int, np.ndarray]], locate: Locate) -> None:
        self.epoch, self.items = epoch, items
        self.located = [locate(ids) for _, ids in items]
        self.last_use = {int(s): b for b, (shards, _) in enumerate(self.located) for s in shards}
        self.order = list(dict.fromkeys(int(s) for shards, _ in self.located for s in shards))
        self.cursor = 0  # into ``order``: shards before it are held or done with

    def wanted(self, start: int, stop: int, readahead: int, held: set[int]) -> dict[int, None]:
        """Shards micro-batches ``[start, stop)`` need, in order of need, then the next ``readahead`` not yet held
        in order of first use among those still to be used at ``start``."""
        wanted = dict.fromkeys(int(s) for shards, _ in self.located[start:stop] for s in shards)
        order, last_use = self.order, self.last_use
        while self.cursor < len(order) and (order[self.cursor] in held or last_use[order[self.cursor]] < start):
            self.cursor += 1
        wanted.update(dict.fromkeys(s for s in order[self.cursor:self.cursor + readahead] if last_use[s] >= start))
        return wanted


def decode_plan(epochs: Iterable[tuple[int, list[tuple[int, np.ndarray]]]], locate: Locate, prefetch: int,
                readahead: int = 0) -> Iterator[PlannedBatch]:
    """The micro-batches of ``epochs`` in order, each with the shard decodes to start before it and the shards to
    let go after it.

    Args:
        epochs: per epoch, ``(epoch, [(step, ids [B])])`` (``CacheStream.plan``'s, or a worker's share of it).
        locate: global ids -> (shard positions, indices within their shards).
        prefetch: micro-batches after the current one whose shards are decoded ahead.
        readahead: further shards decoded ahead in order of first use (object stores).
    """
    upcoming = (_Epoch(epoch, items, locate) for epoch, items in epochs)
    held: set[int] = set()
    current = next(upcoming, None)
    while current is not None:
        following: _Epoch | None = None
        claimed: dict[int, None] = {}  # shards the next epoch's window asked for, in order: kept past this epoch
        for b, (step, ids) in enumerate(current.items):
            stop = b + prefetch + 1
            wanted = current.wanted(b, stop, readahead, held)
            if stop > len(current.items):  # the window reaches into the next epoch
                following = next(upcoming, None) if following is None else following
                if following is not None:
                    # Its read-ahead skips only what it has claimed: a shard held now is claimed (kept), not skipped.
                    claimed.update(following.wanted(0, stop - len(current.items), readahead, set(claimed)))
                    wanted.update(claimed)
            # In order of need: the batch about to be assembled waits for its own shards only.
            decode = tuple(s for s in wanted if s not in held)
            held |= wanted.keys()
            shards, local = current.located[b]
            release = tuple(sorted(s for s in {int(x) for x in shards}
                                   if current.last_use[s] == b and s not in claimed))
            held -= set(release)
            yield PlannedBatch(current.epoch, step, ids, shards, local, decode, release)
        current = following if following is not None else next(upcoming, None)
