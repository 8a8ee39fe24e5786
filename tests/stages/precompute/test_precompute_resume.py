"""Preemption and scale-out of stage one: kill -9 and rerun, a second writer, job arrays, torchrun ranks, and the
shards written by worker processes (``--writer-processes``, issue 43: the same bytes as writer threads; a writer
process killed with -9, a full disk and Ctrl-C each stop the run clearly and resume). What those cannot show is
whether the teacher's kernel launches still wait for the GIL: that needs a GPU run (``benchmarks/bench_gpu.py``).

Every variant must give the same cache, array for array and shard checksum for shard checksum, as one
uninterrupted process: shards are fixed sequence ranges and batches never cross a shard.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.precompute.writer_processes import WORKER_MARK, pack, unpack
from kdcache.storage import CacheReader, CacheWriter, verify_cache
from tests.helpers.cache_files import cache_files
from tests.helpers.tiny_models import sample_texts, write_text_dataset

REPO = Path(__file__).resolve().parents[3]


def _options(teacher: Path, data: Path, out: Path, **overrides: object) -> dict:
    opts = dict(teacher=str(teacher), data=str(data), out=str(out), max_length=40, batch_size=2,
                sequences_per_shard=2, layers=("0", "2"), features=("hidden", "attention", "logits"), top_k=8,
                attention_layers=("1",), progress=False)
    opts.update(overrides)
    return opts


def _argv(opts: dict) -> list[str]:
    argv = ["precompute"]
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    return argv


def assert_same_cache(a: Path, b: Path) -> None:
    """Same spec, fingerprints, shard checksums and every array of every sequence; the same bytes in every shard
    file (data and sidecars) and in the tokenizer folder."""
    ra, rb = CacheReader(a), CacheReader(b)
    assert ra.spec == rb.spec and ra.fingerprints == rb.fingerprints
    for i in range(len(ra)):  # values first: a failure then names the sequence, the array and how far apart
        x, y = ra[i], rb[i]
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=f"sequence {i} {name}")
    assert [(r.index, r.checksum, r.num_tokens) for r in ra.records] == \
           [(r.index, r.checksum, r.num_tokens) for r in rb.records]
    files_a, files_b = cache_files(a), cache_files(b)
    assert files_a.keys() == files_b.keys() and [k for k in files_a if files_a[k] != files_b[k]] == []


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "data.jsonl", sample_texts(40, seed=11))


@pytest.fixture()
def reference(tiny_gpt2: Path, corpus: Path, tmp_path: Path) -> Path:
    run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, tmp_path / "reference")))
    return tmp_path / "reference"


def _env() -> dict[str, str]:
    """A ``kdcache`` process's environment, on one thread: a CPU teacher's forward under ``inference_mode`` was
    seen to round a process's first batch otherwise in the last bit (fp16 hidden states one step apart at 5 of
    1,280 values, fp32 logsumexps one unit) when that process's first batch ran beside CPU contention (its own
    writer processes starting, a parallel test run), MKL's CNR mode (tests/conftest.py) notwithstanding. The tests
    compare caches of separate processes byte for byte, so the processes they start compute on one thread (a whole
    quiet run gave the same bytes on one thread as this process's default two, the in-process references')."""
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
def test_kill_9_then_rerun_gives_identical_cache(tiny_gpt2: Path, corpus: Path, reference: Path,
                                                  tmp_path: Path) -> None:
    out = tmp_path / "killed"
    argv = _argv(_options(tiny_gpt2, corpus, out))
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", *argv], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("shard-*.json"))) >= 3:
            os.kill(proc.pid, signal.SIGKILL)  # mid-run: 3 of 20 shards committed, others in flight
            break
        time.sleep(0.005)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    committed = len(list((out / "shards").glob("shard-*.json")))
    assert 3 <= committed < 20
    summary = run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, out)))
    assert summary["status"] == "complete" and summary["shards_skipped"] == committed
    assert summary["shards_written"] == 20 - committed
    assert_same_cache(reference, out)
    assert verify_cache(out).ok


def test_rerun_of_complete_cache_writes_nothing(tiny_gpt2: Path, corpus: Path, reference: Path) -> None:
    summary = run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, reference)))
    assert summary["shards_written"] == 0 and summary["shards_skipped"] == 20 and summary["status"] == "complete"


def test_second_concurrent_writer_is_refused(tiny_gpt2: Path, corpus: Path, reference: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    existing, out = CacheReader(reference), tmp_path / "busy"
    # A live writer of part 0 of 1 on a cache still being written (a finished cache needs no writer at all).
    with CacheWriter(out, existing.spec, existing.fingerprints):
        code = main(_argv(_options(tiny_gpt2, corpus, out)))
    err = capsys.readouterr().err
    assert code == 2 and "locked" in err and "Traceback" not in err


def test_job_array_parts_merge_into_valid_cache(tiny_gpt2: Path, corpus: Path, reference: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "array"
    for index in (0, 1):
        run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, out, num_shards=3, shard_index=index)))
    assert main(["merge", str(out)]) == 1  # part 2 has not run: partial
    assert "partial" in capsys.readouterr().out
    summary = run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, out, num_shards=3, shard_index=2)))
    assert summary["part"] == [2, 3] and summary["shards_written"] == 6  # shards 2, 5, 8, 11, 14, 17
    assert main(["merge", str(out)]) == 0
    assert "complete" in capsys.readouterr().out
    assert verify_cache(out).ok
    assert_same_cache(reference, out)


@pytest.mark.slow
def test_two_torchrun_ranks_equal_one_process(tiny_gpt2: Path, corpus: Path, reference: Path,
                                              tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    argv = _argv(_options(tiny_gpt2, corpus, out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "kdcache", *argv]
    env = _env()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "complete" in done.stdout and done.stdout.count("cache ") == 1  # only rank 0 prints the summary
    # The summary counts both ranks' work: every shard of the cache, written in this run.
    shards = int(re.search(r"complete, (\d+)/\1 shards", done.stdout).group(1))  # type: ignore[union-attr]
    assert f"this run: {shards} shard(s) written, 0 already committed" in done.stdout, done.stdout
    sidecars = {p.name for p in (out / "locks").glob("part-*")}
    assert sidecars == {"part-00000-of-00002.lock", "part-00001-of-00002.lock"}
    assert_same_cache(reference, out)


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*"))


@pytest.mark.parametrize("writers", [1, 3])
def test_full_disk_exits_2_then_rerun_gives_identical_cache(tiny_gpt2: Path, corpus: Path, reference: Path,
                                                             small_tmpfs: Path, capsys: pytest.CaptureFixture,
                                                             writers: int) -> None:
    """Also with several writer threads: the first one to fill the disk stops the run with the same message."""
    out, filler = small_tmpfs / "cache", small_tmpfs / "filler"
    room = _disk_bytes(reference) // 2  # about half the cache fits
    filler.write_bytes(bytes(max(0, shutil.disk_usage(small_tmpfs).free - room)))
    code = main(_argv(_options(tiny_gpt2, corpus, out, writers=writers, queue_size=1)))
    err = capsys.readouterr().err
    assert code == 2 and "disk full while writing" in err and str(out) in err and "free" in err, err
    assert "Traceback" not in err and err.count("\n") == 1
    assert not [p.name for p in (out / "shards").iterdir() if p.name.startswith(".tmp")]
    assert 0 < len(list((out / "shards").glob("shard-*.json"))) < 20
    assert not verify_cache(out).ok  # never looks complete
    filler.unlink()
    assert main(_argv(_options(tiny_gpt2, corpus, out, writers=writers))) == 0
    assert_same_cache(reference, out)
    assert verify_cache(out).ok


def test_a_shard_crosses_in_one_block_and_comes_back_equal() -> None:
    rng = np.random.default_rng(0)
    padded = rng.standard_normal((3, 7, 5)).astype(np.float16)
    items = [{"input_ids": np.arange(7, dtype=np.int32), "hidden/2": padded[0, :6]},  # a view, as cut_padding's
             {"input_ids": np.arange(3, dtype=np.int32), "hidden/2": padded[1, :3, ::2],  # not contiguous
              "logits/topk_ids": rng.integers(0, 300, (3, 8)).astype(np.uint16)},
             {"input_ids": np.zeros(0, dtype=np.int32), "hidden/2": padded[2, :0]}]  # empty
    block, layout = pack(items)
    try:
        back = unpack(block, layout, len(items))
        assert [list(b) for b in back] == [list(i) for i in items]
        for got, want in zip(back, items):
            for name in want:
                assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
                np.testing.assert_array_equal(got[name], want[name])
        assert all(start % 64 == 0 for *_, start in layout)
        del back, got
    finally:
        block.close()
        block.unlink()


def test_writer_processes_write_the_bytes_writer_threads_write(tiny_gpt2: Path, corpus: Path, reference: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "processes"
    summary = run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, out, writer_processes=True,
                                                             writers=2, queue_size=1)))
    assert summary["status"] == "complete" and summary["shards_written"] == 20
    assert_same_cache(reference, out)
    assert verify_cache(out).ok


def _writer_processes(parent: int) -> list[int]:
    """The live writer processes of ``parent`` (children whose environment carries ``WORKER_MARK``)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line for line in status.read_text().splitlines() if line.startswith("PPid:"))
            environ = (status.parent / "environ").read_bytes()
        except (OSError, StopIteration):
            continue
        if int(ppid.split()[1]) == parent and f"{WORKER_MARK}=1".encode() in environ.split(b"\0"):
            found.append(int(status.parent.name))
    return found


def _run_until(out: Path, argv: list[str], committed: int,
               act: Callable[[int], bool]) -> subprocess.CompletedProcess:
    """Start ``kdcache precompute``; once ``committed`` shards are in, ``act(pid)``; wait for it to end.

    Started as a terminal's foreground command is, with Ctrl-C at its default: a suite run as a background job
    (``make test &`` in a script) has SIGINT ignored, which a child inherits (Python then installs no
    KeyboardInterrupt for it). The wrapper resets it and replaces itself with kdcache (same pid)."""
    start = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
             "os.execv(sys.executable, [sys.executable, '-m', 'kdcache', *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", start, *argv], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "shards").glob("shard-*.json"))) >= committed and act(proc.pid):
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, "", err)


def _slow_options(tiny_gpt2: Path, corpus: Path, out: Path) -> dict:
    """One sequence a shard and one at a time: 40 shards, so that a signal lands mid-run."""
    return _options(tiny_gpt2, corpus, out, writer_processes=True, writers=2, queue_size=1, batch_size=1,
                    sequences_per_shard=1)


@pytest.mark.slow
def test_a_writer_process_killed_with_9_stops_the_run_clearly_and_the_rerun_resumes(tiny_gpt2: Path, corpus: Path,
                                                                                     tmp_path: Path) -> None:
    def kill_one(pid: int) -> bool:
        writers = _writer_processes(pid)
        if writers:
            os.kill(writers[0], signal.SIGKILL)
        return bool(writers)

    for _attempt in range(3):  # a kill that lands after the last shard stops nothing: run again
        out = tmp_path / "killed"
        shutil.rmtree(out, ignore_errors=True)
        done = _run_until(out, _argv(_slow_options(tiny_gpt2, corpus, out)), 2, kill_one)
        if done.returncode != 0:
            break
    assert done.returncode == 2, done.stderr[-3000:]
    assert "writer process" in done.stderr and "killed by signal 9 (SIGKILL)" in done.stderr, done.stderr
    assert "rerun the same command to resume" in done.stderr and "Traceback" not in done.stderr
    committed = len(list((out / "shards").glob("shard-*.json")))
    assert 2 <= committed < 40 and not verify_cache(out).ok  # never looks complete
    summary = run_precompute(PrecomputeOptions.of(**_slow_options(tiny_gpt2, corpus, out)))
    assert summary["status"] == "complete" and summary["shards_skipped"] == committed
    whole = tmp_path / "whole"
    run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, whole, batch_size=1, sequences_per_shard=1)))
    assert_same_cache(whole, out)


@pytest.mark.slow
def test_ctrl_c_with_writer_processes_stops_as_with_threads_and_the_rerun_resumes(tiny_gpt2: Path, corpus: Path,
                                                                                  tmp_path: Path) -> None:
    out = tmp_path / "interrupted"
    seen: list[int] = []

    def interrupt(pid: int) -> bool:
        seen.extend(_writer_processes(pid))
        os.kill(pid, signal.SIGINT)
        return True

    done = _run_until(out, _argv(_slow_options(tiny_gpt2, corpus, out)), 3, interrupt)
    assert done.returncode == 130 and "kdcache precompute: interrupted" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and seen  # the writers were running when the signal came
    time.sleep(0.5)
    assert not [pid for pid in seen if Path(f"/proc/{pid}").exists()], "a writer process outlived the run"
    summary = run_precompute(PrecomputeOptions.of(**_slow_options(tiny_gpt2, corpus, out)))
    assert summary["status"] == "complete"
    whole = tmp_path / "whole"
    run_precompute(PrecomputeOptions.of(**_options(tiny_gpt2, corpus, whole, batch_size=1, sequences_per_shard=1)))
    assert_same_cache(whole, out)


def test_a_full_disk_under_writer_processes_exits_2_then_resumes(tiny_gpt2: Path, corpus: Path, reference: Path,
                                                                  small_tmpfs: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    out, filler = small_tmpfs / "cache", small_tmpfs / "filler"
    room = _disk_bytes(reference) // 2  # about half the cache fits
    filler.write_bytes(bytes(max(0, shutil.disk_usage(small_tmpfs).free - room)))
    argv = _argv(_options(tiny_gpt2, corpus, out, writer_processes=True, writers=2, queue_size=1))
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "disk full while writing" in err and "Traceback" not in err, err
    assert 0 < len(list((out / "shards").glob("shard-*.json"))) < 20 and not verify_cache(out).ok
    filler.unlink()
    assert main(argv) == 0
    assert_same_cache(reference, out)
