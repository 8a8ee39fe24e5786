"""Small pieces of stage one: batch planning, padding, partitions, the background writer, overflow checks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.stages.precompute.commit import BackgroundWriter
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan
from kdcache.stages.precompute.core.targets import parse_layers
from kdcache.stages.precompute.rows.batching import Partition, collate, plan_batches
from kdcache.stages.targets import attention as attention_sources, logits as logit_kinds
from kdcache.storage.core.errors import Fp16OverflowError


def test_plan_batches_sorts_by_length_and_covers_everything() -> None:
    lengths = np.array([3, 9, 1, 9, 5, 2, 7])
    batches = plan_batches(lengths, 3)
    assert [b.tolist() for b in batches] == [[1, 3, 6], [4, 0, 5], [2]]  # longest first, ties in data order
    assert sorted(np.concatenate(batches).tolist()) == list(range(7))


def test_collate_pads_right() -> None:
    ids, mask = collate([np.array([5, 6, 7]), np.array([8])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_partition_combines_job_array_and_ranks() -> None:
    parts = [Partition.of(job, 2, rank, 3) for job in range(2) for rank in range(3)]
    owned = [p.shards(20) for p in parts]
    assert sorted(sum(owned, [])) == list(range(20))  # every shard exactly once
    assert Partition.of(1, 2, 2, 3) == Partition(5, 6) and owned[5] == [5, 11, 17]


def test_parse_layers() -> None:
    assert parse_layers(("all",), 4, minimum=0, name="layers") == (0, 1, 2, 3, 4)
    assert parse_layers(("all",), 4, minimum=1, name="attention_layers") == (1, 2, 3, 4)
    assert parse_layers(("4", "-1", "0", "-2"), 4, minimum=0, name="layers") == (0, 3, 4)
    with pytest.raises(PrecomputeError, match="layer 5 is out of range"):
        parse_layers(("5",), 4, minimum=0, name="layers")
    with pytest.raises(PrecomputeError, match="layer 0 is out of range"):
        parse_layers(("0",), 4, minimum=1, name="attention_layers")


def test_background_writer_overlaps_and_keeps_order() -> None:
    written: list[int] = []
    main_thread = threading.get_ident()
    threads: set[int] = set()

    def write(index: int, sequences: list) -> object:
        threads.add(threading.get_ident())
        time.sleep(0.01)
        written.append(index)
        return index

    writer = BackgroundWriter(write, queue_size=1)
    for k in range(5):
        writer.submit(k, [])
    writer.close()
    assert written == [0, 1, 2, 3, 4] and main_thread not in threads


def test_background_writers_share_the_shards_and_stop_at_the_first_error() -> None:
    """Several workers write different shards at once (each exactly once); after an error nothing more is written,
    and the error reaches the main thread."""
    written: list[int] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def write(index: int, sequences: list) -> object:
        time.sleep(0.02)
        with lock:
            threads.add(threading.get_ident())
            written.append(index)
        return index

    writer = BackgroundWriter(write, queue_size=2, workers=3)
    for k in range(12):
        writer.submit(k, [])
    writer.close()
    assert sorted(written) == list(range(12)) and len(threads) > 1

    def failing(index: int, sequences: list) -> object:
        if index == 2:
            raise OSError("disk full")
        time.sleep(0.01)
        return index

    writer = BackgroundWriter(failing, queue_size=1, workers=2)
    with pytest.raises(OSError, match="disk full"):
        for k in range(40):
            writer.submit(k, [])
        writer.close()


def test_background_writers_hold_at_most_queue_size_plus_workers_shards() -> None:
    """The bound the help states: shards handed over but not yet written never exceed --queue-size + --writers."""
    lock = threading.Lock()
    state = {"held": 0, "peak": 0}

    def write(index: int, sequences: list) -> object:
        time.sleep(0.03)  # a slow disk: the producer must wait in submit
        with lock:
            state["held"] -= 1
        return index

    writer = BackgroundWriter(write, queue_size=2, workers=3)
    for k in range(20):
        with lock:
            state["held"] += 1
        writer.submit(k, [])
        with lock:
            state["peak"] = max(state["peak"], state["held"])
    writer.close()
    assert state["held"] == 0 and 3 <= state["peak"] <= 2 + 3


def test_background_writer_reraises_in_main_thread() -> None:
    def write(index: int, sequences: list) -> object:
        if index == 1:
            raise OSError("disk full")
        return index

    writer = BackgroundWriter(write, queue_size=1)
    with pytest.raises(OSError, match="disk full"):
        for k in range(50):
            writer.submit(k, [])
        writer.close()
    writer.close()  # a second close (a finally block) does not raise the same error again


def test_fp16_overflow_names_the_layer(tiny_gpt2: Path, tmp_path: Path) -> None:
    """A hidden state beyond 65504 is refused with the layer's name, never stored as inf."""
    from kdcache.stages.precompute.capture.features import FeatureCapture, finish
    from kdcache.stages.precompute.core.targets import resolve_targets
    from kdcache.stages.precompute.teacher import load_teacher, load_tokenizer, read_config

    opts = PrecomputeOptions.of(teacher=str(tiny_gpt2), data="unused", out=str(tmp_path / "c"), layers=("2",),
                             features=("hidden",))
    setup = PrecomputePlan.of(opts).teacher
    config = read_config(setup)
    targets = resolve_targets(opts, config)
    teacher = load_teacher(setup, config, targets, load_tokenizer(setup), torch.device("cpu"))
    with torch.no_grad():
        teacher.model.h[1].mlp.c_proj.bias.fill_(1e5)  # block 2's output blows past the fp16 range
    ids = torch.tensor([[5, 6, 7]])
    with FeatureCapture(teacher, targets, "fp16") as capture:
        pending = capture.run(ids, torch.ones_like(ids), [3])  # queued: the check comes when the host takes it
        with pytest.raises(Fp16OverflowError, match="hidden/2"):
            finish(pending)
    with FeatureCapture(teacher, targets, "bf16") as capture:  # bf16 has float32's range
        out = capture.run(ids, torch.ones_like(ids), [3])
    stored = finish(out)[0]["hidden/2"]
    assert stored.dtype == np.uint16 and stored.shape == (3, 32)


def test_sizes_are_binary_units_labelled_as_such() -> None:
    from kdcache.stages.precompute.core.progress import format_summary
    from kdcache.storage.core.files import format_bytes

    assert [format_bytes(n) for n in (512, 1536, 5 * 2 ** 20, 3 * 2 ** 30)] == ["512 B", "1.5 KiB", "5.0 MiB",
                                                                                "3.0 GiB"]
    summary = {"out": "c", "status": "complete", "committed_shards": 1, "num_shards": 1, "num_sequences": 2,
               "cache_tokens": 10, "shards_written": 1, "shards_skipped": 0, "tokens": 10, "compute_seconds": 1.0,
               "tokens_per_second": 10.0, "wall_seconds": 1.0, "bytes_written": 37_224_448, "bytes_per_token": {}}
    text = format_summary(summary)
    assert "35.5 MiB written" in text and " MB" not in text and " KB" not in text


def test_room_for_queries_and_keys_is_sized_per_token_not_as_maps() -> None:
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from kdcache.stages.precompute.estimate import lower_bound_bytes
    from kdcache.storage import CacheSpec

    # The spec sized before the teacher loads names maps whatever --attention-source says.
    spec = CacheSpec(num_sequences=4, hidden_layers=(), attention_layers=(1, 2), logits=None)
    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=2)
    tokens = 4 * 4096
    data = SimpleNamespace(meta={"tokens": {"": tokens}, "sum_sq_lengths": {"": 4 * 4096 ** 2}})
    assert lower_bound_bytes(spec, config, data) == 2 * 8 * 4 * 4096 ** 2 * 2  # blocks x H x sum L^2 x fp16
    qk, qkv = attention_sources.get("qk"), attention_sources.get("qkv")
    assert lower_bound_bytes(spec, config, data, qk) == 2 * tokens * (8 + 2) * 8 * 2  # (H + H_kv) x head_dim
    assert lower_bound_bytes(spec, config, data, qkv) == 2 * tokens * (8 + 2 + 2) * 8 * 2


def test_an_explicit_default_hidden_codec_keeps_the_settings_fingerprint(tiny_gpt2: Path, tmp_path: Path) -> None:
    from kdcache.stages.precompute.core.targets import resolve_targets, settings_fingerprint
    from kdcache.stages.precompute.teacher import read_config

    def settings(**more: object) -> dict[str, object]:
        options = PrecomputeOptions.of(teacher=str(tiny_gpt2), data=str(tmp_path / "d.jsonl"),
                                       out=str(tmp_path / "c"), features=("hidden",), **more)
        return settings_fingerprint(options, resolve_targets(options, read_config(PrecomputePlan.of(options).teacher)))

    plain = settings()
    assert "hidden_codec" not in plain
    assert settings(hidden_codec="fp16") == plain  # the fp16 dtype's own codec, given explicitly
    assert settings(hidden_codec="bf16", dtype="bf16") == settings(dtype="bf16")
    assert settings(hidden_codec="int8")["hidden_codec"]["name"] == "int8"


def test_the_targets_carry_each_familys_record_whole_into_the_spec_and_the_fingerprint(tiny_gpt2: Path,
                                                                                        tmp_path: Path) -> None:
    from kdcache.stages.precompute.cache_spec import build_spec
    from kdcache.stages.precompute.core.targets import resolve_targets, settings_fingerprint
    from kdcache.stages.precompute.rows.data import TokenStreams
    from kdcache.stages.precompute.teacher import read_config

    options = PrecomputeOptions.of(teacher=str(tiny_gpt2), data=str(tmp_path / "d.jsonl"), out=str(tmp_path / "c"),
                                   features=("hidden", "attention", "logits"), layers=("1",),
                                   logits_mode="sampled:7", sample_temperature=0.5)
    plan = PrecomputePlan.of(options)
    targets = resolve_targets(options, read_config(plan.teacher))
    assert targets.logit == options.targets.logit.settings(options.targets.features)
    assert targets.logit.kind is logit_kinds.get("sampled")
    assert targets.attention == options.targets.attention.settings()
    assert targets.attention.source is attention_sources.get("maps")
    spec = build_spec(plan.write, targets, TokenStreams({"": [np.arange(5, dtype=np.int32)]}, {}))
    assert (spec.logits, spec.samples, spec.sample_temperature, spec.top_k, spec.attention_source) == (
        "sampled", 7, 0.5, 0, "maps")
    fingerprint = settings_fingerprint(options, targets)
    assert fingerprint.items() >= {**targets.logit.fingerprint(), **targets.attention.fingerprint()}.items()


def test_the_devices_gather_cuts_the_same_sequences_as_the_hosts_views(tiny_llama: Path, tmp_path: Path) -> None:
    """The GPU's path (padding dropped by a gather before the copy) run on the CPU gives every sequence's arrays
    exactly as the CPU's path (views of the padded arrays) does: hidden states, q/k, attention maps, logits."""
    from kdcache.stages.precompute.capture.features import FeatureCapture, finish
    from kdcache.stages.precompute.capture.transfer import HostCopier
    from kdcache.stages.precompute.core.targets import resolve_targets
    from kdcache.stages.precompute.teacher import load_teacher, load_tokenizer, read_config

    opts = PrecomputeOptions.of(teacher=str(tiny_llama), data="unused", out=str(tmp_path / "c"), layers=("0", "2"),
                                features=("hidden", "attention", "logits"), top_k=8, topk_values="logprob")
    setup = PrecomputePlan.of(opts).teacher
    config = read_config(setup)
    targets = resolve_targets(opts, config)
    teacher = load_teacher(setup, config, targets, load_tokenizer(setup), torch.device("cpu"))
    ids = torch.randint(3, 200, (3, 9))
    lengths = [9, 5, 2]
    mask = (torch.arange(9)[None] < torch.tensor(lengths)[:, None]).long()
    runs = []
    for gather in (False, True):
        with FeatureCapture(teacher, targets, "fp16") as capture:
            capture._copier = HostCopier(torch.device("cpu"), gather=gather)
            runs.append(finish(capture.run(ids, mask, lengths)))
    views, gathered = runs
    assert views.finite == gathered.finite and "hidden/2" in views.finite
    for a, b, n in zip(views, gathered, lengths):
        assert sorted(a) == sorted(b) and a["hidden/2"].shape[0] == n and a["attention/2"].shape[-2:] == (n, n)
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def test_the_teachers_pipeline_runs_on_across_shard_boundaries() -> None:
    """A shard is handed on with the next shard's batches already queued on the device (the pipeline never drains
    between shards), every sequence lands in its own shard in data order, and the device-finite set is the
    intersection over the shard's batches."""
    from types import SimpleNamespace

    from kdcache.stages.precompute.capture.transfer import ShardItems
    from kdcache.stages.precompute.core.options import IN_FLIGHT
    from kdcache.stages.precompute.core.progress import Progress, RunStats
    from kdcache.stages.precompute.stream import stream_shards

    seqs = [np.arange(3 + i % 3, dtype=np.int64) + 10 * i for i in range(12)]  # 3 shards of 4, batches of 2
    data = SimpleNamespace(ids={"": seqs}, tokens={})
    teacher = SimpleNamespace(device=torch.device("cpu"), tokenizer=SimpleNamespace(pad_token_id=0))
    options = PrecomputeOptions.of(teacher="t", data="d", out="o", batch_size=2)
    events: list[str] = []

    def capture(padded: dict, lengths: dict, positions: dict):  # noqa: ANN202 - the Capture protocol's shape
        events.append("capture")
        first = padded[""][0].numpy()
        finite = frozenset({"a", "b"}) if len(events) != 2 else frozenset({"a"})  # batch 2 of shard 0: a only
        return lambda: ShardItems([{"first": row[:n]} for row, n in zip(first, lengths[""])], finite=finite)

    stats = RunStats()
    out = []
    for shard in stream_shards(capture, teacher, data, [(0, 4), (4, 8), (8, 12)], options.engine.batch_size, stats,  # type: ignore[arg-type]
                               Progress(0, False, stats)):
        out.append((events.count("capture"), shard))
    assert [captured for captured, _ in out[:2]] == [4 + IN_FLIGHT - 2, 6 + IN_FLIGHT - 2]  # next shard queued
    assert [shard.finite for _, shard in out] == [frozenset({"a"}), frozenset({"a", "b"}), frozenset({"a", "b"})]
    flat = [item for _, shard in out for item in shard]
    assert len(flat) == 12 and stats.sequences == 12 and stats.tokens == sum(len(s) for s in seqs)
    for item, seq in zip(flat, seqs):
        np.testing.assert_array_equal(item["input_ids"], seq)
        np.testing.assert_array_equal(item["first"], seq)


def test_copies_out_of_pinned_memory_reuse_their_buffers_once_the_shard_is_written(tmp_path: Path) -> None:
    """The GPU's take (``HostBatch.ready`` moving a landed copy out of pinned memory) run on CPU tensors: the
    copies are exact, live in the copier's reused buffers, and those come back only when the shard that holds
    their views has been written (``commit.BackgroundWriter``), also when that write failed."""
    from kdcache.stages.precompute.capture.features import finish
    from kdcache.stages.precompute.capture.transfer import HostBatch, _pageable
    from kdcache.storage.buffers import BufferPool, Lease

    pool = BufferPool()
    hidden = torch.randn(2 * 600, 1024).to(torch.float16)  # flat [T, d] of two sequences: 2.3 MiB, pooled

    def landed() -> HostBatch:
        batch = HostBatch(np.array([600, 600]), {"hidden/1": hidden.clone()}, pool=pool)
        batch.pinned = True  # as after ``wait`` on a GPU: the tensors are the pinned ones
        return batch

    class Writer:  # the one call commit_behind makes of a CacheWriter
        def __init__(self, fail: bool) -> None:
            self.fail, self.seen = fail, []

        def write_shard(self, index: int, items: list, finite: frozenset = frozenset()) -> int:
            self.seen.append([item["hidden/1"].copy() for item in items])
            if self.fail:
                raise OSError(28, "No space left on device")
            return index

    items = finish(landed())
    np.testing.assert_array_equal(np.concatenate([i["hidden/1"] for i in items]), hidden.numpy())
    assert pool.free_bytes == 0 and len(items.leases) == 1  # held while the shard waits for its writer
    def write_then_release(writer: Writer, index: int, shard: list) -> int:  # commit_behind's writer threads
        records: list[int] = []
        background = BackgroundWriter(writer.write_shard, on_written=lambda k, record, _: records.append(record))
        background.submit(index, shard)
        background.close()
        return records[0]

    writer = Writer(fail=False)
    assert write_then_release(writer, 3, items) == 3
    np.testing.assert_array_equal(np.concatenate(writer.seen[0]), hidden.numpy())  # written before release
    assert pool.free_bytes >= hidden.numel() * 2 and items.leases == []
    again = finish(landed())  # the next batch's copy lands in the same memory
    assert np.shares_memory(again[0]["hidden/1"], items[0]["hidden/1"])
    with pytest.raises(OSError):
        write_then_release(Writer(fail=True), 4, again)
    assert pool.free_bytes >= hidden.numel() * 2 and again.leases == []
    bf16 = torch.randn(2048, 512).to(torch.bfloat16)  # no numpy twin (never stored as such): new memory, exact
    assert torch.equal(_pageable(bf16, Lease(BufferPool())), bf16)


def test_a_log_s_last_progress_line_counts_every_shard_s_bytes(tiny_gpt2: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """stderr is not a terminal here, so progress comes as lines: the last one, printed once the writer committed
    the last shard, says the bytes the summary says (it said "0 B written" while the writers were still busy)."""
    from kdcache.pipeline.cli import main
    from kdcache.storage import format_bytes
    from tests.helpers.tiny_models import sample_texts, write_text_dataset
    from tests.stages.precompute.test_precompute_resume import _argv, _options

    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(12, seed=3))
    opts = _options(tiny_gpt2, data, tmp_path / "cache", progress=True)
    assert main([*_argv(opts), "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("kdcache precompute: ")]
    assert lines and lines[-1].startswith("kdcache precompute: 12/12 sequences")
    assert lines[-1].endswith(f"| {format_bytes(summary['bytes_written'])} written") and summary["bytes_written"] > 0
