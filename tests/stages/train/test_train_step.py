"""Stage two's step on the CPU, for real (tiny GPT-2 cache from stage one, DeepSpeed ZeRO-0): no host read of a
device value between log steps, and checkpoints that fail cleanly (sizes announced, a full disk exits 2 and leaves
the previous checkpoint usable)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from tests.helpers.sync_counter import SyncCounter
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, precompute_cache


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("step")
    teacher = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=32,
                             extra=("--features", "hidden,logits", "--top-k", "8"))
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    return {"root": root, "cache": cache, "student": student}


def _options(setup: dict[str, Path], name: str, **kw: object) -> TrainOptions:
    base = dict(cache=str(setup["cache"]), student=str(setup["student"]), out=str(setup["root"] / name),
                batch_size=4, lr=3e-3, log_every=4, max_steps=8, zero_stage=0)
    base.update(kw)
    return TrainOptions.of(**base)  # type: ignore[arg-type]


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    yield SyncCounter(monkeypatch)


def test_the_step_reads_nothing_back_between_log_steps(setup: dict[str, Path], counter: SyncCounter) -> None:
    """CE + top-k KL + hidden MSE (the default run): 0 host reads in 7 micro-steps, and one sync in each of them
    only: the vocabulary pass's index of the valid rows (its size is theirs; without it every padded row would go
    through the LM head too). The hidden losses mask instead of selecting rows, so they add none."""
    summary = run_training(_options(setup, "nosync", export=False))
    assert counter.micro_steps == 8 and summary["steps"] == 8
    assert len(counter.calls) == 7 and {call.split(":")[0] for call in counter.calls} == {"stages/targets/logits/vocab/vocab_pass.py"}
    records = read_jsonl(setup["root"] / "nosync" / "metrics.jsonl")
    assert [r["step"] for r in records] == [4, 8] and all(r["tokens"] > 0 for r in records)
    assert summary["tokens_per_s"] > 0


@pytest.mark.triton
def test_the_fused_kernel_s_step_makes_no_sync_at_all(setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                       counter: SyncCounter) -> None:
    """The same run through the fused Triton kernel (under the interpreter here, as on a GPU): rows that count
    nothing are masked in the kernel's coefficients, not selected, so not even the index of valid rows is built."""
    from kdcache.stages.targets.logits.vocab import fused_vocab, vocab_kernels

    pytest.importorskip("triton")
    monkeypatch.setattr(fused_vocab, "INTERPRET_ON_CPU", True)
    launched: list[int] = []
    real = vocab_kernels.row_stats
    monkeypatch.setattr(vocab_kernels, "row_stats", lambda z, *a: launched.append(len(z)) or real(z, *a))
    # Two rows a batch and three steps: the interpreter runs the kernel's programs one by one in Python.
    summary = run_training(_options(setup, "fused", export=False, batch_size=2, max_steps=3, log_every=3))
    assert counter.micro_steps == 3 and summary["steps"] == 3
    assert counter.calls == [] and launched


def test_the_counter_sees_a_sync_when_there_is_one(setup: dict[str, Path], counter: SyncCounter) -> None:
    """--trace-samples reads the loss every micro-step (its help says so): the counter must see it."""
    run_training(_options(setup, "traced", export=False, trace_samples=True, max_steps=2))
    assert any(call.startswith("stages/train/loop.py") for call in counter.calls)


@contextlib.contextmanager
def _small_disk(path: Path, size: int) -> Iterator[Path]:
    """A real filesystem of ``size`` bytes at ``path`` (tmpfs): writes past it fail with ENOSPC, as a full disk's."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def _argv(setup: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out", str(out),
            "--zero-stage", "0", "--batch-size", "4", "--log-every", "2", "--no-export", *extra]


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_destination_that_cannot_hold_one_checkpoint_is_refused(setup: dict[str, Path], tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with _small_disk(tmp_path / "small", 64 * 1024) as disk:
        assert main(_argv(setup, disk / "run", "--max-steps", "2")) == 2
    err = capsys.readouterr().err
    assert "free, and one checkpoint of this student needs ~" in err and "Traceback" not in err


def test_a_disk_filling_during_a_save_exits_2_and_the_run_resumes_from_the_previous(
        setup: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Room for the run's files and one checkpoint and a half: step 2's checkpoint fits, step 4's does not."""
    assert main(_argv(setup, tmp_path / "measure", "--max-steps", "2")) == 0
    one = _size(tmp_path / "measure" / "checkpoints")
    assert "each checkpoint ~" in capsys.readouterr().err
    room = _size(tmp_path / "measure") + one // 2 + 64 * 1024  # the log and run files grow a little meanwhile
    with _small_disk(tmp_path / "disk", room) as disk:
        assert main(_argv(setup, disk / "run", "--max-steps", "4", "--save-every", "2")) == 2
        err = capsys.readouterr().err
        assert "the disk filled up while writing checkpoint step4" in err and "Traceback" not in err
        assert "the previous checkpoint step2 is intact" in err
        assert (disk / "run" / "checkpoints" / "latest").read_text() == "step2"
        assert not (disk / "run" / "checkpoints" / "step4").exists()  # the partial tag is gone
        shutil.copytree(disk / "run", tmp_path / "moved")
    # The run's own options (the CLI's default rate): a resume with others is refused (issue 61)
    summary = run_training(_options(setup, "unused", out=str(tmp_path / "moved"), resume=True, max_steps=4,
                                    save_every=2, export=False, lr=1e-4))  # --lr's default
    assert summary["resumed_from"] == 2 and summary["steps"] == 4


@pytest.mark.parametrize(("weights", "said"), [((), True), (("--alpha", "0", "--beta", "0"), False)])
def test_the_vocabulary_path_is_said_only_where_there_are_vocabulary_losses(
        setup: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], weights: tuple[str, ...],
        said: bool) -> None:
    assert main(_argv(setup, tmp_path / "run", "--max-steps", "1", *weights)) == 0
    err = capsys.readouterr().err
    assert ("kdcache train: vocabulary losses:" in err) == said, err[-2000:]


def _plant_kernel(monkeypatch: pytest.MonkeyPatch, wrong: str) -> None:
    """The fused kernel forced on under the interpreter, its gradient launcher planted: ``raise`` raises as a
    compile error would; ``scale`` writes dz 2% too large."""
    from kdcache.stages.targets.logits.vocab import fused_vocab, vocab_kernels

    pytest.importorskip("triton")
    monkeypatch.setattr(fused_vocab, "INTERPRET_ON_CPU", True)
    real = vocab_kernels.write_grad

    def planted(z: object, *args: object) -> None:
        if wrong == "raise":
            raise RuntimeError("planted: the kernel failed to compile")
        real(z, *args)
        z.mul_(1.02)  # type: ignore[attr-defined]
    monkeypatch.setattr(vocab_kernels, "write_grad", planted)


def _weights(run: Path) -> dict[str, object]:
    from safetensors.torch import load_file

    return load_file(str(run / "student" / "model.safetensors"))


@pytest.mark.triton
def test_a_wrong_kernel_on_auto_trains_as_the_pure_torch_pass_does(setup: dict[str, Path], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A planted kernel writing dz 2% too large (unguarded, it trained on silently) is caught on its first chunk;
    the run says so in one line and its weights after 3 steps are the pure-torch road's."""
    import torch

    argv = ("--max-steps", "3", "--batch-size", "2", "--export")
    assert main(_argv(setup, tmp_path / "torch", *argv, "--vocab-kernel", "torch")) == 0
    _plant_kernel(monkeypatch, "scale")
    assert main(_argv(setup, tmp_path / "auto", *argv)) == 0
    err = capsys.readouterr().err
    assert err.count("kdcache: the fused vocabulary kernel disagrees with the pure-torch pass") == 1, err[-3000:]
    want, got = _weights(tmp_path / "torch"), _weights(tmp_path / "auto")
    gap = max(float((got[k] - want[k]).abs().max()) for k in want)  # type: ignore[operator]
    assert gap < 1e-6 and all(torch.isfinite(v).all() for v in got.values())  # type: ignore[arg-type]


@pytest.mark.triton
def test_a_failing_kernel_on_fused_exits_2_naming_it(setup: dict[str, Path], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    _plant_kernel(monkeypatch, "raise")
    assert main(_argv(setup, tmp_path / "run", "--max-steps", "1", "--vocab-kernel", "fused")) == 2
    err = capsys.readouterr().err
    assert "the fused vocabulary kernel raised RuntimeError: planted" in err and "Traceback" not in err


def test_fused_on_a_cpu_is_refused_before_training(setup: dict[str, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_argv(setup, tmp_path / "run", "--max-steps", "1", "--vocab-kernel", "fused")) == 2
    err = capsys.readouterr().err
    assert "--vocab-kernel fused needs a CUDA device (this run is on cpu)" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()
