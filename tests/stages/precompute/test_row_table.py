"""Rows built once per cache (issue 26): one build shared by ranks, parts and reruns, invalidated by what the rows
depend on; streaming input; the size estimate and the up-front refusal of a destination too small."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.core.plan import PrecomputePlan
from kdcache.stages.precompute.rows.row_build import pair_streams, text_streams
from kdcache.stages.precompute.rows.row_store import ROWS_ENV
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.precompute.teacher import load_tokenizer
from kdcache.storage import CacheReader
from kdcache.storage.core.canonical import canonical_json
from kdcache.storage.folders import TABLE, seal_local_folder
from tests.helpers.tiny_models import make_tiny_bart, sample_pairs, sample_texts, write_pair_dataset, write_text_dataset
from tests.stages.precompute.test_precompute_resume import assert_same_cache


def _rows_of(out: Path) -> Path:
    """The rows folder these tests give the cache at ``out`` (``KDCACHE_ROWS``; conftest restores it after each)."""
    return out.parent / f"{out.name}.rows"


def _opts(teacher: Path, data: Path, out: Path, **more: Any) -> PrecomputeOptions:
    os.environ[ROWS_ENV] = str(_rows_of(out))  # one rows folder per cache here, so each test sees its own builds
    flat = dict(teacher=str(teacher), data=str(data), out=str(out), max_length=40, batch_size=4,
                sequences_per_shard=4, layers=("0", "2"), features=("hidden", "attention", "logits"), top_k=8,
                attention_layers=("1",), progress=False)
    return PrecomputeOptions.of(**{**flat, **more})


def _streams(options: PrecomputeOptions) -> Any:
    plan = PrecomputePlan.of(options)
    return text_streams(plan.rows, load_tokenizer(plan.teacher))


def _row_folders(out: Path) -> list[str]:
    return sorted(p.name for p in _rows_of(out).iterdir() if p.is_dir())


def _same_rows(a: Any, b: Any) -> None:
    assert a.fingerprint == b.fingerprint and len(a) == len(b)
    for name in ("loss_mask", "position_ids"):
        assert (name in a.tokens) == (name in b.tokens)
    for i in range(len(a)):
        np.testing.assert_array_equal(a.ids[""][i], b.ids[""][i])
        for name in a.tokens:
            np.testing.assert_array_equal(a.tokens[name][i], b.tokens[name][i])


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "corpus.jsonl", sample_texts(120, seed=3))


def test_rerun_and_job_array_parts_reuse_the_rows(tiny_gpt2: Path, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "cache"
    first = run_precompute(_opts(tiny_gpt2, corpus, out, num_shards=2, shard_index=0))
    second = run_precompute(_opts(tiny_gpt2, corpus, out, num_shards=2, shard_index=1))
    rerun = run_precompute(_opts(tiny_gpt2, corpus, out, num_shards=2, shard_index=1))
    assert first["rows"]["built"] and not second["rows"]["built"] and not rerun["rows"]["built"]
    assert len(_row_folders(out)) == 1
    meta = _rows_of(out) / _row_folders(out)[0] / "rows.json"  # canonical, like every JSON kdcache writes
    assert meta.read_bytes() == canonical_json(json.loads(meta.read_bytes()))
    single = tmp_path / "single"
    run_precompute(_opts(tiny_gpt2, corpus, single))
    assert main(["merge", str(out)]) == 0
    assert_same_cache(single, out)


def _build_in_child(options: PrecomputeOptions, queue: Any) -> None:
    data = _streams(options)
    queue.put((data.built, data.fingerprint, [a.tolist() for a in data.ids[""][:]]))


def test_concurrent_ranks_build_once_and_see_the_same_rows(tiny_gpt2: Path, corpus: Path, tmp_path: Path) -> None:
    options = _opts(tiny_gpt2, corpus, tmp_path / "cache", packing="documents")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(options, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(built for built, _, _ in results) == [False, True]  # one built, the other waited and opened
    assert results[0][1:] == results[1][1:]
    _same_rows(_streams(options), _streams(_opts(tiny_gpt2, corpus, tmp_path / "alone", packing="documents")))


def test_parallel_tokenizing_gives_the_rows_of_one_process(tiny_llama: Path, corpus: Path, tmp_path: Path) -> None:
    for packing in ("none", "documents", "concat"):
        one = _streams(_opts(tiny_llama, corpus, tmp_path / f"one-{packing}", packing=packing, tokenize_workers=1))
        two = _streams(_opts(tiny_llama, corpus, tmp_path / f"two-{packing}", packing=packing, tokenize_workers=2))
        assert one.built and two.built
        _same_rows(one, two)


def _row_files(out: Path) -> list[str]:
    return sorted(p.name for p in _rows_of(out).rglob("*") if p.is_file() and p.suffix != ".lock")


def test_parallel_tokenizing_keeps_no_second_copy_of_the_tokens(tiny_llama: Path, corpus: Path,
                                                                tmp_path: Path) -> None:
    assert _streams(_opts(tiny_llama, corpus, tmp_path / "two", tokenize_workers=2)).built
    assert _row_files(tmp_path / "two") == [TABLE, "rows.arrow", "rows.json"]  # no datasets.map output left inside


def test_pairs_tokenized_by_two_workers_give_the_rows_of_one(tmp_path: Path) -> None:
    teacher = make_tiny_bart(tmp_path / "bart")
    data = write_pair_dataset(tmp_path / "pairs.jsonl", sample_pairs(30, seed=4))
    built = {}
    for procs in (1, 2):
        os.environ[ROWS_ENV] = str(_rows_of(tmp_path / f"c{procs}"))
        options = PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(tmp_path / f"c{procs}"),
                                       source_column="source", target_column="target", max_length=40,
                                       tokenize_workers=procs, progress=False)
        plan = PrecomputePlan.of(options)
        built[procs] = pair_streams(plan.rows, load_tokenizer(plan.teacher))
        assert built[procs].built and _row_files(tmp_path / f"c{procs}") == [TABLE, "rows.arrow", "rows.json"]
    assert built[1].fingerprint == built[2].fingerprint and len(built[1]) == len(built[2]) > 0
    for name in built[1].tokens:
        for i in range(len(built[1])):
            np.testing.assert_array_equal(built[1].tokens[name][i], built[2].tokens[name][i])


def test_data_tokenizer_and_packing_changes_invalidate_the_rows(tiny_gpt2: Path, tiny_llama: Path, corpus: Path,
                                                                  tmp_path: Path) -> None:
    out = tmp_path / "cache"
    base = _streams(_opts(tiny_gpt2, corpus, out))
    assert base.built and not _streams(_opts(tiny_gpt2, corpus, out)).built
    changed = [_opts(tiny_gpt2, corpus, out, packing="documents"), _opts(tiny_gpt2, corpus, out, max_length=20),
               _opts(tiny_llama, corpus, out)]
    for options in changed:
        assert _streams(options).built
    with corpus.open("a") as fh:
        fh.write(json.dumps({"text": "one more line of data"}) + "\n")
    grown = _streams(_opts(tiny_gpt2, corpus, out))
    assert grown.built and len(grown) == len(base) + 1
    assert grown.fingerprint["input_ids_hash"] != base.fingerprint["input_ids_hash"]
    assert len(_row_folders(out)) == 5


def test_chat_template_change_invalidates_the_rows(tiny_llama: Path, tmp_path: Path) -> None:
    chats = [[{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]
             for t in sample_texts(20, seed=1)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    out = tmp_path / "cache"
    templates = ["{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                 "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"]
    hashes = []
    for i, text in enumerate(templates):
        (tmp_path / f"t{i}.jinja").write_text(text)
        options = _opts(tiny_llama, data, out, messages_column="messages", chat_template=str(tmp_path / f"t{i}.jinja"))
        rows = _streams(options)
        assert rows.built
        hashes.append(rows.fingerprint["input_ids_hash"])
    assert hashes[0] != hashes[1] and len(_row_folders(out)) == 2


def test_streaming_a_jsonl_folder_gives_the_same_cache(tiny_gpt2: Path, tmp_path: Path) -> None:
    folder = tmp_path / "parts"
    folder.mkdir()
    texts = sample_texts(90, seed=5)
    for i in range(3):
        write_text_dataset(folder / f"part-{i}.jsonl", texts[i * 30:(i + 1) * 30])
    plain, streamed = tmp_path / "plain", tmp_path / "streamed"
    run_precompute(_opts(tiny_gpt2, folder, plain, packing="documents"))
    summary = run_precompute(_opts(tiny_gpt2, folder, streamed, packing="documents", streaming=True))
    assert summary["status"] == "complete" and summary["rows"]["built"]
    assert_same_cache(plain, streamed)


def test_estimate_is_within_15_percent_of_the_real_cache(tiny_gpt2: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    data = write_text_dataset(tmp_path / "big.jsonl", sample_texts(600, seed=7))
    out = tmp_path / "cache"
    argv = ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(out), "--max-length", "40",
            "--sequences-per-shard", "8", "--features", "hidden,attention,logits", "--layers", "0,3",
            "--attention-layers", "2", "--top-k", "8", "--no-progress"]
    assert main([*argv, "--estimate", "--json"]) == 0
    guess = json.loads(capsys.readouterr().out)
    assert guess["status"] == "estimate" and guess["sample_rows"] < guess["num_sequences"] / 4
    assert guess["fits"] is True and not (out / "manifest.json").exists()
    assert main(argv) == 0
    real = CacheReader(out)
    stored = sum(r.stored_bytes for r in real.records)
    assert guess["tokens"] == real.manifest.num_tokens
    assert abs(guess["total_bytes"] - stored) <= 0.15 * stored, (guess["total_bytes"], stored)
    assert {"hidden/0", "attention/2", "logits/topk"} <= set(guess["bytes_per_token"])
    assert main([*argv, "--estimate"]) == 0  # the human lines: a run of seconds is told in seconds, not "0.00 h"
    time_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("total: "))
    assert re.search(r"; time: \d+(\.\d+)? (s|min) ", time_line), time_line


def test_estimate_times_several_passes_and_gives_a_range(tiny_gpt2: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """One timing on a busy machine swung 18 s -> 58 s between two runs: the estimate times the sample more than
    once and reports the median with the fastest and slowest passes around it."""
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(40, seed=7))
    argv = ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(tmp_path / "cache"),
            "--max-length", "40", "--layers", "3", "--no-progress", "--estimate"]
    assert main([*argv, "--json"]) == 0
    guess = json.loads(capsys.readouterr().out)
    rates = guess["sample_rates"]
    assert len(rates) >= 3 and all(r > 0 for r in rates), guess
    fastest, slowest = guess["seconds_range"]
    assert fastest <= guess["seconds"] <= slowest, guess
    assert guess["sample_tokens_per_second"] == pytest.approx(sorted(rates)[len(rates) // 2], rel=0.01)
    assert main(argv) == 0
    time_line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("total: "))
    assert re.search(rf"median of {len(rates)} timed passes over 40 rows .* to .* from the fastest pass to the "
                     r"slowest", time_line), time_line


def test_the_estimate_s_first_pass_is_not_timed(tiny_gpt2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """The pass that writes the sample pays the one-off costs (a --compile-teacher compile, kernels chosen): here
    its first shard sleeps 2 s, and no timed pass may read that slow (each takes a fraction of a second)."""
    import time

    from kdcache.stages.precompute import estimate as estimate_module, runner

    real, calls = estimate_module.estimate, []

    def slow_first(spec, data, out, compute, fingerprints):  # type: ignore[no-untyped-def]
        def counted(bounds):  # type: ignore[no-untyped-def]
            calls.append(bounds)
            if len(calls) == 1:
                time.sleep(2.0)
            return compute(bounds)
        return real(spec, data, out, counted, fingerprints)
    monkeypatch.setattr(runner, "estimate", slow_first)  # the name the runner calls
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(40, seed=7))
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(tmp_path / "cache"),
                 "--max-length", "40", "--layers", "3", "--no-progress", "--estimate", "--json"]) == 0
    guess = json.loads(capsys.readouterr().out)
    assert len(calls) == (1 + estimate_module.TIMED_PASSES) * len(set(calls)), calls
    assert min(guess["sample_rates"]) > guess["tokens"] / 2.0, guess  # all 40 rows are the sample


def test_durations_read_in_their_own_unit() -> None:
    from kdcache.stages.precompute.estimate import format_duration

    assert [format_duration(s) for s in (0.4, 42, 450, 24_840)] == ["0.40 s", "42 s", "7.5 min", "6.90 h"]


def test_a_destination_too_small_is_refused_before_the_teacher_loads(tiny_gpt2: Path, corpus: Path,
                                                                    small_tmpfs: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    teacher = tmp_path / "config-only"  # no weights: loading the teacher would fail with another error
    teacher.mkdir()
    for f in tiny_gpt2.iterdir():
        if not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, teacher / f.name)
    config = json.loads((teacher / "config.json").read_text())
    (teacher / "config.json").write_text(json.dumps({**config, "vocab_size": 1 << 20}))
    out = small_tmpfs / "cache"  # 8 MiB; full logits over 2^20 ids take 2 MiB a token
    code = main(["precompute", "--teacher", str(teacher), "--data", str(corpus), "--out", str(out),
                 "--max-length", "40", "--full-logits", "--features", "hidden,logits", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "out: the cache needs at least" in err and "free" in err and str(out) in err, err
    assert not (out / "shards").exists()


def test_only_the_process_that_built_removes_the_lock_file(tmp_path: Path) -> None:
    from kdcache.stages.precompute.rows.row_store import open_or_build
    from kdcache.storage.fingerprint import hash_json

    def refuse(writer: Any) -> Any:
        raise ValueError("bad data")

    root = tmp_path / "cache" / "rows"
    with pytest.raises(ValueError, match="bad data"):
        open_or_build(root, {"data": 1}, ("input_ids",), {}, refuse)
    assert not (tmp_path / "cache").exists()  # the builder left nothing behind, its lock file included
    folder = root / hash_json({"data": 2})[7:23]
    folder.mkdir(parents=True)
    (folder / "rows.json").write_text("{")  # another process's rows, sealed as written but unreadable:
    seal_local_folder(folder)  # intact by their table, so this process only opens them (damaged ones it rebuilds)
    with pytest.raises((ValueError, OSError)):
        open_or_build(root, {"data": 2}, ("input_ids",), {}, refuse)
    assert (root / f"{folder.name}.lock").is_file()
