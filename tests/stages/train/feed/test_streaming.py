"""The streaming dataset: a deterministic order, a clean partition, exact resumption, padding and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kdcache.stages.train.feed.streaming import (
    CacheStream,
    DataPosition,
    StreamStateError,
    check_resumable,
    collate,
    epoch_order,
    next_position,
    rank_batches,
    steps_per_epoch,
    to_device,
)
from kdcache.storage import CacheReader, to_float32
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import write_cache

NAMES = ["input_ids", "hidden/1", "attention/2", "logits/topk_values", "logits/topk_ids", "logits/lse"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("stream")
    teacher = make_tiny_gpt2(root / "teacher", layers=2)
    fp16 = write_cache(teacher, root / "fp16", num_sequences=30, sequences_per_shard=4)
    bf16 = write_cache(teacher, root / "bf16", num_sequences=12, sequences_per_shard=4, dtype="bf16",
                       backend="arrow")
    return {"fp16": fp16, "bf16": bf16}


def _ids(stream: CacheStream, limit: int | None = None, **loader: object) -> list[tuple[int, int, list[int]]]:
    out = []
    for batch in torch.utils.data.DataLoader(stream, batch_size=None, **loader):
        out.append((batch["epoch"], batch["step_in_epoch"], batch["sample_ids"].tolist()))
        if limit is not None and len(out) == limit:
            break
    return out


def test_epoch_order_is_a_seeded_permutation_with_local_blocks() -> None:
    ranges = [(i * 10, min((i + 1) * 10, 95)) for i in range(10)]
    a = epoch_order(ranges, seed=3, epoch=0, shuffle_block=20)
    assert sorted(a.tolist()) == list(range(95))
    assert np.array_equal(a, epoch_order(ranges, seed=3, epoch=0, shuffle_block=20))
    assert not np.array_equal(a, epoch_order(ranges, seed=3, epoch=1, shuffle_block=20))
    assert not np.array_equal(a, epoch_order(ranges, seed=4, epoch=0, shuffle_block=20))
    # A block of 20 after the shard shuffle touches at most 3 shards of 10: decoded shards stay few.
    for start in range(0, 95, 20):
        assert len({int(i) // 10 for i in a[start:start + 20]}) <= 3


def test_ranks_partition_the_epoch_without_repeats_and_drop_the_tail() -> None:
    order = epoch_order([(0, 50), (50, 103)], seed=0, epoch=2, shuffle_block=16)
    world, batch = 3, 4
    n = steps_per_epoch(len(order), world, batch)
    assert n == 103 // 12
    seen = [i for r in range(world) for b in rank_batches(order, r, world, batch) for i in b.tolist()]
    assert len(seen) == len(set(seen)) == n * world * batch  # each rank the same number of steps
    assert set(order.tolist()) - set(seen) == set(order[n * world * batch:].tolist())  # the dropped tail


def test_stream_follows_the_plan_across_epochs(caches: dict) -> None:
    stream = CacheStream(caches["fp16"], NAMES, batch_size=4, seed=1, epochs=2, shuffle_block=8)
    got = _ids(stream)
    assert len(got) == 2 * stream.steps_per_epoch == 14
    for epoch in (0, 1):
        order = epoch_order(stream.shard_ranges, 1, epoch, 8)
        want = [b.tolist() for b in rank_batches(order, 0, 1, 4)]
        assert [ids for e, _, ids in got if e == epoch] == want


def test_workers_do_not_change_the_stream(caches: dict) -> None:
    kwargs = dict(batch_size=3, seed=5, epochs=1, shuffle_block=6, world_size=2, rank=1)
    single = _ids(CacheStream(caches["fp16"], ["input_ids"], **kwargs))
    multi = _ids(CacheStream(caches["fp16"], ["input_ids"], **kwargs), num_workers=2)
    assert single == multi and len(single) == 5


class _RowLengths:
    """A batch extension (module level: DataLoader workers pickle it): each row's real token count."""

    def __call__(self, batch: dict) -> None:
        batch["row_lengths"] = batch["mask"].sum(1) * 10 + batch["sample_ids"] % 10


def test_an_extension_adds_its_arrays_where_batches_are_made(caches: dict) -> None:
    """In the stream's own thread and in a DataLoader worker alike; a reference from the cache's lengths."""
    reader = CacheReader(caches["fp16"])
    kwargs = dict(batch_size=3, seed=2, epochs=1, shuffle_block=6)
    for loader in ({}, {"num_workers": 1}):
        stream = CacheStream(caches["fp16"], ["input_ids"], extend=_RowLengths(), **kwargs)
        batches = list(torch.utils.data.DataLoader(stream, batch_size=None, **loader))
        assert len(batches) == 10
        for batch in batches:
            ids = batch["sample_ids"].tolist()
            want = [len(reader.get(i, ["input_ids"])["input_ids"]) * 10 + i % 10 for i in ids]
            assert batch["row_lengths"].tolist() == want


def test_resume_from_a_position_yields_exactly_the_rest(caches: dict) -> None:
    kwargs = dict(batch_size=2, seed=9, world_size=2, rank=0, shuffle_block=5)
    full = _ids(CacheStream(caches["fp16"], ["input_ids"], epochs=3, **kwargs))
    per_epoch = steps_per_epoch(30, 2, 2)
    for cut in (1, per_epoch - 1, per_epoch, per_epoch + 3):
        e, k, _ = full[cut - 1]
        pos = next_position(e, k, 2, 2, per_epoch)
        rest = _ids(CacheStream(caches["fp16"], ["input_ids"], epochs=3, start=pos, **kwargs))
        assert rest == full[cut:]


def test_batches_hold_the_cached_values_padded_and_masked(caches: dict) -> None:
    reader = CacheReader(caches["fp16"])
    batch = next(iter(CacheStream(caches["fp16"], NAMES, batch_size=4, seed=0, shuffle_block=4)))
    assert batch["hidden/1"].dtype == torch.float16  # fp16 all the way to the device
    lengths = batch["mask"].sum(1)
    size = int(lengths.max())
    assert batch["input_ids"].shape == (4, size) and batch["attention/2"].shape[-2:] == (size, size)
    for row, seq in enumerate(batch["sample_ids"].tolist()):
        ref, n = reader.get(seq, names=NAMES), int(lengths[row])
        assert np.array_equal(batch["input_ids"][row, :n].numpy(), ref["input_ids"])
        assert np.array_equal(batch["hidden/1"][row, :n].numpy(), ref["hidden/1"])
        assert np.array_equal(batch["attention/2"][row, :, :n, :n].numpy(), ref["attention/2"])
        assert np.array_equal(batch["logits/topk_ids"][row, :n].numpy(), ref["logits/topk_ids"])
        assert not batch["hidden/1"][row, n:].any() and not batch["attention/2"][row, :, n:].any()
        assert not batch["attention/2"][row, :, :, n:].any() and not batch["input_ids"][row, n:].any()
    moved = to_device(batch, "cpu")
    assert moved["hidden/1"].dtype == torch.float32 and moved["logits/topk_ids"].dtype == torch.int64


def test_bf16_bits_become_the_same_float32_as_storage(caches: dict) -> None:
    reader = CacheReader(caches["bf16"])
    batch = next(iter(CacheStream(caches["bf16"], ["input_ids", "hidden/2"], batch_size=3, seed=0)))
    assert batch["hidden/2"].dtype == torch.int16  # bf16 bits, reinterpreted only on the device
    moved = to_device(batch, "cpu")
    for row, seq in enumerate(batch["sample_ids"].tolist()):
        n = int(batch["mask"][row].sum())
        want = to_float32(reader.get(seq, names=["hidden/2"])["hidden/2"], "bf16")
        assert np.array_equal(moved["hidden/2"][row, :n].numpy(), want)


def test_collate_pads_ragged_sequences() -> None:
    seqs = [{"input_ids": np.array([5, 6, 7], np.int32), "hidden/0": np.ones((3, 2), np.float16),
             "attention/1": np.ones((2, 3, 3), np.float16)},
            {"input_ids": np.array([8], np.int32), "hidden/0": np.ones((1, 2), np.float16),
             "attention/1": np.ones((2, 1, 1), np.float16)}]
    batch = collate(seqs, [10, 11])
    assert batch["mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention/1"].shape == (2, 2, 3, 3) and float(batch["attention/1"][1].sum()) == 2.0
    assert batch["sample_ids"].tolist() == [10, 11]


def test_resume_refuses_other_settings_and_tiny_caches(caches: dict) -> None:
    saved = {"epoch": 1, "sample_index": 8, "world_size": 2, "batch_size": 4, "seed": 0}
    assert check_resumable(saved, 2, 4, 0) == DataPosition(1, 8)
    with pytest.raises(StreamStateError, match="world_size was 2 in the checkpoint, now 4"):
        check_resumable(saved, 4, 4, 0)
    with pytest.raises(StreamStateError, match="fewer than one step"):
        CacheStream(caches["bf16"], ["input_ids"], batch_size=8, world_size=2)
