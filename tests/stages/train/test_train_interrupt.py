"""Ctrl-C and SIGTERM during ``kdcache train`` keep the work (issue 32): the step in flight finishes, a checkpoint
is saved, the message says how to resume, the exit status is 130 (143), and ``--resume`` ends where an
uninterrupted run ends.

Backend nondeterminism: on the CPU (one process, fp32, gloo) a resumed run replays the same micro-batches with the
same per-step dropout seeds, so the weights agree to the last bit in practice; the test allows 1e-6 absolute,
the rounding of a reordered float32 reduction. (On a GPU, atomics in the backward make two uninterrupted runs
differ by about 1e-5 relative already.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, precompute_cache

REPO = Path(__file__).resolve().parents[3]
STEPS = 60
ATOL = 1e-6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interrupt")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=32)
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)  # dropout 0.1
    shutil.rmtree(teacher)
    return {"root": root, "cache": cache, "student": student}


def _argv(setup: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out", str(out),
            "--zero-stage", "0", "--max-steps", str(STEPS), "--batch-size", "2", "--lr", "3e-3", "--delta", "1",
            "--gamma", "1", "--log-every", "1", "--quiet", *extra]


def _last_step(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.strip()), default=0)


def _interrupt(argv: list[str], run: Path, signum: int | None, after: int = 0) -> tuple[int, str]:
    """Run ``kdcache`` in a subprocess, sending ``signum`` (if any) once the run has logged step ``after``; its
    exit status and stderr. Every run is a subprocess with one thread, so that the runs compared differ only in
    their interruptions (a thread count changes the order of float reductions)."""
    launcher = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # an in-process run's world
    env = {**{k: v for k, v in os.environ.items() if k not in launcher}, "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", *argv], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while signum is not None and proc.poll() is None and time.time() < deadline:
        if _last_step(run) >= after:
            proc.send_signal(signum)
            break
        time.sleep(0.01)
    _, err = proc.communicate(timeout=240)
    return proc.returncode, err


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "student" / "model.safetensors"))


@pytest.mark.slow
def test_sigint_then_sigterm_then_resume_ends_with_the_uninterrupted_weights(setup: dict[str, Path]) -> None:
    straight, run = setup["root"] / "straight", setup["root"] / "interrupted"
    code, err = _interrupt(_argv(setup, straight), straight, None)
    assert code == 0, err[-3000:]

    code, err = _interrupt(_argv(setup, run), run, signal.SIGINT, after=3)
    first = _last_step(run)
    assert code == 130, err[-3000:]
    assert 3 <= first < STEPS and f"step {first} is saved in {run}/checkpoints" in err and "--resume" in err
    assert "Traceback" not in err and (run / "checkpoints" / f"step{first}").is_dir()
    assert not (run / "student").exists()  # nothing exported from a run that did not finish

    code, err = _interrupt(_argv(setup, run, "--resume"), run, signal.SIGTERM, after=first + 3)
    second = _last_step(run)
    assert code == 143, err[-3000:]
    assert first < second < STEPS and "SIGTERM" in err and (run / "checkpoints" / f"step{second}").is_dir()

    code, err = _interrupt(_argv(setup, run, "--resume"), run, None)
    assert code == 0, err[-3000:]
    want, got = _weights(straight), _weights(run)
    assert want.keys() == got.keys()
    worst = max(float((want[k] - got[k]).abs().max()) for k in want)
    assert worst <= ATOL, worst
