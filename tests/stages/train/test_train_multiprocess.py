"""Stage two as 2 processes under ``torchrun --nproc_per_node 2`` (gloo on the CPU): ZeRO-3 and a ZeRO-2 resume."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.stages.train.feed.streaming import epoch_order, rank_batches
from kdcache.stages.train.logging import read_jsonl
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, write_cache

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torchrun")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    cache = write_cache(teacher, root / "cache", num_sequences=40, sequences_per_shard=5)
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    shutil.rmtree(teacher)
    return {"root": root, "cache": cache, "student": student}


def _torchrun(setup: dict[str, Path], out: str, *extra: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "kdcache", "train", "--cache", str(setup["cache"]), "--student", str(setup["student"]),
           "--out", str(setup["root"] / out), "--batch-size", "2", "--lr", "3e-3", "--delta", "1",
           "--log-every", "1", "--trace-samples", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_two_ranks_under_zero3_split_the_data_and_learn(setup: dict[str, Path]) -> None:
    _torchrun(setup, "z3", "--zero-stage", "3", "--max-steps", "8")
    run = setup["root"] / "z3"
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]
    assert len(losses) == 8 and sum(losses[-3:]) < sum(losses[:3])
    ranks = [read_jsonl(run / f"samples-rank{r}.jsonl") for r in (0, 1)]
    # 40 sequences / (2 ranks x 2) = 10 steps per epoch; each rank reads its own part of epoch 0's order.
    order = epoch_order([(i, min(i + 5, 40)) for i in range(0, 40, 5)], 0, 0, 1024)
    for rank, trace in enumerate(ranks):
        assert [r["sample_ids"] for r in trace] == [b.tolist() for b in rank_batches(order, rank, 2, 2)][:8]
    seen = [i for trace in ranks for r in trace for i in r["sample_ids"]]
    assert len(seen) == len(set(seen)) == 32
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(run / "student"))  # gathered from both ranks' shards


def test_two_ranks_resume_exactly_under_zero2(setup: dict[str, Path]) -> None:
    _torchrun(setup, "z2", "--zero-stage", "2", "--max-steps", "3")
    _torchrun(setup, "z2", "--zero-stage", "2", "--max-steps", "8", "--resume")
    reference = setup["root"] / "z3"  # same data order and seeds; ZeRO stage does not change the maths
    for rank in (0, 1):
        got = read_jsonl(setup["root"] / "z2" / f"samples-rank{rank}.jsonl")
        want = read_jsonl(reference / f"samples-rank{rank}.jsonl")
        assert [r["sample_ids"] for r in got] == [r["sample_ids"] for r in want]
        assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-4)
