"""``--compile-teacher`` (issue 43): the teacher's forward through torch.compile (inductor on the CPU here) writes the
cache the eager forward writes, within the rounding of fused kernels, and records that it asked for it; where
compiling fails the run says why once and writes the eager cache itself.

What these cannot show: whether fewer, fused launches let the teacher's process keep a GPU busy (a GPU run of
``benchmarks/bench_gpu.py``). Compiling takes about 20 s here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kdcache.pipeline.children import child_env
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def _precompute(teacher: Path, data: Path, out: Path, **extra: object) -> CacheReader:
    run_precompute(PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(out), max_length=24,
                                        packing="concat", batch_size=4, layers=("1", "3"),
                                        features=("hidden", "logits"), top_k=8, progress=False, **extra))
    return CacheReader(out)


@pytest.fixture(scope="module")
def eager(tiny_gpt2: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CacheReader]:
    root = tmp_path_factory.mktemp("compiled")
    data = write_text_dataset(root / "data.jsonl", sample_texts(24, seed=3))
    return data, _precompute(tiny_gpt2, data, root / "eager")


@pytest.mark.slow
def test_the_compiled_forward_writes_the_eager_cache_within_rounding(tiny_gpt2: Path, eager: tuple[Path, CacheReader],
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data, reference = eager
    compiled = _precompute(tiny_gpt2, data, tmp_path / "compiled", compile_teacher=True)
    err = capsys.readouterr().err
    assert "compiling the teacher failed" not in err  # it compiled: no fallback line
    notes = [ln for ln in err.splitlines() if ln.startswith("kdcache precompute: --compile-teacher")]
    assert len(notes) == 1 and "the eager forward is faster" in notes[0], err  # one note, before compiling
    assert compiled.fingerprints["settings"].pop("compile_teacher") is True  # a resume cannot mix the two
    assert "compile_teacher" not in reference.fingerprints["settings"]
    assert compiled.spec == reference.spec and compiled.fingerprints == reference.fingerprints
    assert len(compiled) == len(reference) > 1
    for i in range(len(reference)):
        got, want = compiled[i], reference[i]
        assert got.keys() == want.keys()
        np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
        for name in ("hidden/1", "hidden/3", "logits/topk_values"):
            np.testing.assert_allclose(got[name].astype(np.float32), want[name].astype(np.float32), rtol=2e-3,
                                       atol=2e-3, err_msg=f"sequence {i} {name}")
        same = (got["logits/topk_ids"] == want["logits/topk_ids"]).mean()
        assert same > 0.97, (i, same)  # a swap only where two logits tie within the rounding


@pytest.mark.slow
def test_a_failed_compile_says_why_once_and_writes_the_eager_cache(tiny_gpt2: Path, eager: tuple[Path, CacheReader],
                                                                   tmp_path: Path) -> None:
    """A host without a C++ compiler (``CXX`` names none, and an empty kernel cache): inductor cannot build its
    kernels, so the run says so once, goes on eagerly, and writes the eager arrays exactly."""
    data, reference = eager
    out = tmp_path / "fell-back"
    argv = ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(out), "--max-length", "24",
            "--packing", "concat", "--batch-size", "4", "--layers", "1,3", "--features", "hidden,logits",
            "--top-k", "8", "--no-progress", "--compile-teacher"]
    # One thread, as test_precompute_resume's children: a process's first batch beside CPU contention was seen to
    # round in the last bit otherwise (a CI run: 8 of 768 fp16 values of sequence 0 one step apart).
    env = child_env(HF_HUB_OFFLINE="1", CXX="/nonexistent/c++", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "kernels"),
                    OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "kdcache", *argv], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("--compile-teacher: compiling the teacher failed") == 1, done.stderr[-3000:]
    assert "it runs eagerly" in done.stderr and "Traceback" not in done.stderr
    fell_back = CacheReader(out)
    for i in range(len(reference)):
        got, want = fell_back[i], reference[i]
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"sequence {i} {name}")


def test_the_compile_note_counts_the_batch_shapes_and_says_where_compiling_pays() -> None:
    """Issue 53: compiled, MiniLM ran 25x slower on a CPU (161.5 s against 6.2 s) without a word. Static shapes
    compile once each, so the note counts this run's shapes: ten rows of lengths 3..7 in shards of 5, batches of 2."""
    import torch

    from kdcache.stages.precompute.capture.compiled import batch_shapes, compile_note

    lengths = np.array([7, 7, 6, 5, 3, 7, 7, 6, 5, 3])
    shapes = batch_shapes(lengths, [(0, 5), (5, 10)], batch_size=2)
    assert shapes == 3  # (2 rows, 7), (2 rows, 6), (1 row, 3): both shards batch alike
    assert batch_shapes(np.full(12, 16), [(0, 6), (6, 12)], batch_size=3) == 1  # packed to one length
    cpu, gpu = compile_note(torch.device("cpu"), shapes), compile_note(torch.device("cuda", 0), shapes)
    for line in (cpu, gpu):
        assert line.startswith("kdcache precompute: --compile-teacher") and "\n" not in line
        assert "3 batch shapes" in line and "compiled once" in line and "--packing concat" in line, line
    assert "the eager forward is faster" in cpu and "drop --compile-teacher" in cpu
    assert "the eager forward is faster" not in gpu and "pays" in gpu
