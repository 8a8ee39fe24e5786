"""Issue 63: the feed's memory ahead of the step. The prefetch queue is bounded in bytes as well as in batches
(``ahead.ByteQueue``), dense ``[B, L, V]`` teacher rows are read per batch rather than kept with their decoded shard,
and ``to_device`` hands them over in their stored dtype; the data order and the values do not change."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.stages.train.api import CacheDataset
from kdcache.stages.train.core.options import DataOptions
from kdcache.stages.train.feed.ahead import PREFETCH_MIB, ByteQueue
from kdcache.stages.train.feed.streaming import CacheStream, StreamStateError, collate, to_device
from kdcache.storage import CacheReader, CacheSpec, CacheWriter, to_float32
from tests.helpers.full_cache import write_full_cache
from tests.storage._seq2seq_suite import FINGERPRINTS, make_seq2seq_sequences

V, LENGTHS = 64, [9, 5, 12, 7, 3, 11, 8, 6, 10, 4]  # 10 sequences of varied length, 4 to a shard
NAMES = ["input_ids", "logits/full"]


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("full")
    return {"fp16": write_full_cache(root / "fp16", LENGTHS, V, 4),
            "bf16": write_full_cache(root / "bf16", LENGTHS, V, 4, dtype="bf16", backend="arrow")}


def _batches(stream: CacheStream) -> list[dict]:
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in stream]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_dense_rows_come_per_batch_in_the_same_order_and_values_under_any_byte_budget(caches: dict[str, Path],
                                                                                      dtype: str) -> None:
    """The batches with a 1 MiB budget (one batch ahead) are those of the default budget and those ``collate``
    makes of whole-shard reads. From zarr the shards the producer decodes hold no dense rows (they are read per
    batch, row ranges only); from Arrow, whose handle decodes a whole column at its first read, they come with their
    shard, decoded once rather than once per batch."""
    reader = CacheReader(caches[dtype])
    asked: list[list[str]] = []
    read_shard = reader.read_shard
    reader.read_shard = lambda index, names=None: asked.append(list(names or [])) or read_shard(index, names)  # type: ignore[method-assign]
    kwargs = dict(batch_size=3, seed=2, epochs=2, shuffle_block=4)
    small = _batches(CacheStream(reader, NAMES, prefetch_mib=1, **kwargs))
    assert reader.reads_row_ranges == (dtype == "fp16")  # the fp16 cache is zarr, the bf16 one Arrow
    assert asked and all(("logits/full" in names) != reader.reads_row_ranges for names in asked)
    default = _batches(CacheStream(caches[dtype], NAMES, **kwargs))
    assert len(small) == len(default) == 2 * (len(LENGTHS) // 3)
    for a, b in zip(small, default):
        assert a.keys() == b.keys() and (a["epoch"], a["step_in_epoch"]) == (b["epoch"], b["step_in_epoch"])
        for name in ("sample_ids", "input_ids", "mask", "logits/full"):
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        whole = [read_shard(i // 4, NAMES).sequence(i % 4) for i in a["sample_ids"].tolist()]
        assert torch.equal(collate(whole, a["sample_ids"].tolist())["logits/full"], a["logits/full"])


def test_to_device_keeps_dense_teacher_rows_as_stored_and_widens_the_rest(caches: dict[str, Path]) -> None:
    """No whole-batch float32 copy of ``[B, L, V]``: fp16 stays fp16, bf16 bits become bf16 (a view); the values
    widen to exactly the stored ones' float32."""
    for dtype, want in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        reader = CacheReader(caches[dtype])
        host = collate([reader.get(i, NAMES) for i in (0, 2)], [0, 2])
        host["hidden/1"] = torch.ones(2, 12, 3, dtype=torch.float16)  # another float target: widened as before
        moved = to_device(host, "cpu")
        assert moved["logits/full"].dtype == want and moved["hidden/1"].dtype == torch.float32
        stored = np.stack([np.pad(to_float32(reader.get(i, NAMES)["logits/full"], dtype), ((0, 12 - n), (0, 0)))
                           for i, n in ((0, LENGTHS[0]), (2, LENGTHS[2]))])
        assert torch.equal(moved["logits/full"].float(), torch.from_numpy(stored))


def test_the_byte_budget_lets_one_big_batch_wait_and_small_ones_by_their_count() -> None:
    stop = threading.Event()
    q = ByteQueue(items=3, budget=100)
    assert q.room(stop)  # nothing queued: a batch of any size may be assembled
    q.put("big", 80, stop)
    blocked = threading.Thread(target=q.room, args=(stop,))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # 80 queued + another 80 would pass 100: the producer waits before assembling
    assert q.get() == "big" and q.queued_bytes == 0
    blocked.join(5)
    assert not blocked.is_alive()
    for i in range(3):  # small batches: the count bound, as a queue.Queue(3), is what stops them
        assert q.room(stop)
        q.put(i, 10, stop)
    putter = threading.Thread(target=q.put, args=(3, 10, stop))
    putter.start()
    putter.join(0.3)
    assert putter.is_alive() and q.queued_bytes == 30
    assert [q.get() for _ in range(4)] == [0, 1, 2, 3]
    putter.join(5)
    q.put("big", 80, stop)
    stop.set()  # a stopped stream never waits
    assert not q.room(stop) and not q.put("more", 1, stop)


def test_a_bad_byte_budget_is_refused_with_its_value(caches: dict[str, Path]) -> None:
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match=rf"prefetch_mib must be a whole number of MiB >= 1, got {bad!r}"):
            CacheStream(caches["fp16"], NAMES, batch_size=2, prefetch_mib=bad)  # type: ignore[arg-type]
    assert "prefetch_mib must be >= 1, got 0" in DataOptions(cache="c", prefetch_mib=0).validate()
    assert DataOptions(cache="c").prefetch_mib == PREFETCH_MIB  # the option's default is the feed's


def test_arrays_asked_without_their_input_ids_are_refused_naming_what_is_missing(caches: dict[str, Path]) -> None:
    """A batch is padded to its stream's input_ids: dense rows asked alone were a bare KeyError('mask') in the
    stream's thread; the stream now refuses them when it is made."""
    with pytest.raises(StreamStateError, match=r"names \['logits/full'\] lack \['input_ids'\]"):
        CacheStream(caches["fp16"], ["logits/full"], batch_size=2)


def test_a_seq2seq_cache_s_dense_rows_come_per_batch_padded_to_the_decoder(tmp_path: Path) -> None:
    """Dense logits live on the last stream: rows read apart are padded to the decoder's mask (they asked for an
    unprefixed ``mask`` that a two-stream batch has not, a KeyError)."""
    spec = CacheSpec.from_dict(dict(num_sequences=3, layout="seq2seq", encoder_hidden_layers=(1,),
                                    decoder_hidden_layers=(1,), logits="full", vocab_size=40, sequences_per_shard=3))
    items = make_seq2seq_sequences(spec, [(5, 3), (2, 6), (4, 4)])
    with CacheWriter(tmp_path / "c", spec, FINGERPRINTS) as writer:
        writer.write_shard(0, items)
        writer.finalize()
    names = ["encoder/input_ids", "decoder/input_ids", "logits/full"]
    batch = next(iter(CacheStream(str(tmp_path / "c"), names, batch_size=3, shuffle_block=1, epochs=1)))
    assert batch["logits/full"].shape == (3, 6, 40) and batch["decoder/mask"].shape == (3, 6)
    for row, i in enumerate(batch["sample_ids"].tolist()):
        expected = items[i]["logits/full"].astype(np.float16)
        np.testing.assert_array_equal(batch["logits/full"][row, :len(expected)].numpy(), expected)


def test_the_python_api_takes_the_byte_budget_and_refuses_a_bad_one(caches: dict[str, Path]) -> None:
    """``CacheDataset`` (and so ``DistillationLoss.dataset`` and ``CacheTrainer``) passes ``prefetch_mib`` to its
    stream, default the CLI's, and refuses a bad value by name."""
    assert CacheDataset(caches["fp16"], NAMES, batch_size=2).prefetch_bytes == PREFETCH_MIB << 20
    assert CacheDataset(caches["fp16"], NAMES, batch_size=2, prefetch_mib=64).prefetch_bytes == 64 << 20
    with pytest.raises(ValueError, match="prefetch_mib must be a whole number of MiB >= 1, got 0"):
        CacheDataset(caches["fp16"], NAMES, batch_size=2, prefetch_mib=0)
