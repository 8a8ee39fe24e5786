"""The stream's decode plan: every batch finds its shards decoded, none is decoded twice while held, the window
runs on across epoch boundaries, and within one epoch the plan is the one the stream followed before."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kdcache.stages.train.feed.decode_plan import PlannedBatch, decode_plan, shard_locator
from kdcache.stages.train.feed.streaming import CacheStream, epoch_order, rank_batches
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import write_cache

RANGES = [(i * 6, (i + 1) * 6) for i in range(8)]  # 8 shards of 6 sequences
_locate = shard_locator(RANGES)


def _epochs(count: int, block: int, batch: int = 4) -> Iterator[tuple[int, list]]:
    for epoch in range(count):
        items = list(enumerate(rank_batches(epoch_order(RANGES, 7, epoch, block), 0, 1, batch)))
        yield epoch, items


def _walk(plan: Iterator[PlannedBatch]) -> tuple[list[PlannedBatch], int, int]:
    """Carry a plan out on sets: every batch's shards held when it is assembled, no decode of a held shard, no
    release of one not held. Returns the batches, the decodes and the most shards held at once."""
    held: set[int] = set()
    batches, decodes, most = [], 0, 0
    for planned in plan:
        assert not held & set(planned.decode), "a held shard decoded again"
        held |= set(planned.decode)
        decodes += len(planned.decode)
        most = max(most, len(held))
        assert {int(s) for s in planned.shards} <= held, f"epoch {planned.epoch} step {planned.step}: not decoded"
        assert set(planned.release) <= held
        held -= set(planned.release)
        batches.append(planned)
    assert not held, f"shards {held} never let go"
    return batches, decodes, most


def _one_epoch_reference(items: list, prefetch: int, readahead: int) -> list[tuple[set[int], tuple[int, ...]]]:
    """The producer's loop before the plan (one epoch seen at a time), written out: decodes and releases."""
    located = [_locate(ids) for _, ids in items]
    last_use = {int(s): b for b, (shards, _) in enumerate(located) for s in shards}
    order = list(dict.fromkeys(int(s) for shards, _ in located for s in shards))
    decoded: set[int] = set()
    cursor, out = 0, []
    for b in range(len(items)):
        wanted = {int(s) for shards, _ in located[b:b + prefetch + 1] for s in shards}
        while cursor < len(order) and (order[cursor] in decoded or last_use[order[cursor]] < b):
            cursor += 1
        wanted.update(s for s in order[cursor:cursor + readahead] if last_use[s] >= b)
        decode = wanted - decoded
        decoded |= wanted
        release = tuple(sorted(s for s in {int(x) for x in located[b][0]} if last_use[s] == b))
        decoded -= set(release)
        out.append((decode, release))
    return out


@pytest.mark.parametrize("block,prefetch,readahead", [(48, 2, 0), (12, 3, 0), (12, 1, 2), (6, 0, 3)])
def test_within_one_epoch_the_plan_is_the_earlier_one(block: int, prefetch: int, readahead: int) -> None:
    (epoch, items), = _epochs(1, block)
    planned = list(decode_plan([(epoch, items)], _locate, prefetch, readahead))
    assert [(set(p.decode), p.release) for p in planned] == _one_epoch_reference(items, prefetch, readahead)
    for p in planned:  # in order of need: the batch's own shards first
        own = list(dict.fromkeys(int(s) for s in p.shards if int(s) in p.decode))
        assert list(p.decode[:len(own)]) == own
    assert [p.ids.tolist() for p in planned] == [ids.tolist() for _, ids in items]


@pytest.mark.parametrize("block,prefetch,readahead", [(48, 2, 0), (12, 3, 0), (12, 1, 2), (6, 4, 1)])
def test_the_window_runs_on_into_the_next_epoch(block: int, prefetch: int, readahead: int) -> None:
    batches, decodes, most = _walk(decode_plan(_epochs(3, block), _locate, prefetch, readahead))
    steps = len(batches) // 3
    assert [(p.epoch, p.step) for p in batches] == [(e, k) for e in range(3) for k in range(steps)]
    for epoch in (1, 2):  # the next epoch's first batch is decoded `prefetch` batches before the boundary
        first = {int(s) for s in batches[epoch * steps].shards}
        ahead = epoch * steps - min(prefetch, steps)
        held: set[int] = set()
        for planned in batches[:ahead + 1]:
            held = (held | set(planned.decode)) - set(planned.release)
        assert first <= held, f"epoch {epoch}'s first shards were not decoding {prefetch} batches ahead"
    # Against one epoch at a time: no more decodes, and at most one window of shards more held at once.
    alone = [_walk(decode_plan([one], _locate, prefetch, readahead)) for one in _epochs(3, block)]
    assert decodes <= sum(d for _, d, _ in alone)
    assert most <= max(m for _, _, m in alone) + (prefetch + 1) * 4 + readahead


def test_a_shard_held_at_the_boundary_is_kept_for_the_next_epoch_not_decoded_again() -> None:
    # One shuffle block spans the whole cache: both ends of every epoch touch most shards.
    batches, decodes, _ = _walk(decode_plan(_epochs(2, 48), _locate, 3))
    alone = sum(_walk(decode_plan([one], _locate, 3))[1] for one in _epochs(2, 48))
    assert decodes < alone
    steps = len(batches) // 2
    later = [s for p in batches[steps - 3:] for s in p.decode]  # decodes from the window's reach on
    assert len(later) == len(set(later))


def test_the_stream_carries_out_the_plan(tmp_path) -> None:
    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=2)
    cache = write_cache(teacher, tmp_path / "cache", num_sequences=24, sequences_per_shard=4)
    reader = CacheReader(cache)
    calls: list[int] = []
    read_shard = reader.read_shard
    reader.read_shard = lambda index, names=None: calls.append(index) or read_shard(index, names)  # type: ignore[method-assign]
    stream = CacheStream(reader, ["input_ids", "hidden/1"], batch_size=4, seed=2, epochs=2, shuffle_block=24,
                         prefetch=2)
    got = [(b["epoch"], b["step_in_epoch"], b["sample_ids"].tolist()) for b in stream]
    plan = list(decode_plan(stream.plan(), shard_locator(stream.shard_ranges), 2))
    assert got == [(p.epoch, p.step, p.ids.tolist()) for p in plan]
    assert sorted(calls) == sorted(stream.shard_ids[s] for p in plan for s in p.decode)
    assert len(calls) < 2 * len(stream.shard_ids)  # shards held at the boundary were not decoded twice


def test_read_ahead_into_the_next_epoch_keeps_a_held_shard_it_reaches() -> None:
    # Shards of two sequences (shard = id // 2). Epoch 0 ends on shards C = 2 and X = 3; epoch 1 first uses C, then
    # X, then A = 0: with prefetch 1 and read-ahead 2 the boundary's window reaches C, its read-ahead C and X.
    def locate(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ids // 2, ids % 2

    epochs = [(0, [(0, np.array([0, 1])), (1, np.array([4, 6]))]),
              (1, [(0, np.array([4, 5])), (1, np.array([6, 0])), (2, np.array([7, 1]))])]
    batches, decodes, _ = _walk(decode_plan(epochs, locate, 1, 2))
    assert [p.epoch for p in batches] == [0, 0, 1, 1, 1]
    assert decodes == 4  # A twice (let go after its use in epoch 0), C and X once: held at the boundary, kept
