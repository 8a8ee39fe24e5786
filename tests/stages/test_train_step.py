"""Stage two's step on the CPU, for real (tiny GPT-2 cache from stage one, DeepSpeed ZeRO-0): no host read of a
device value between log steps, and checkpoints that fail cleanly (sizes announced, a full disk exits 2 and leaves
the previous checkpoint usable)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kdcache.stages.train import loop
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from kdcache.stages.train.options import TrainOptions
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages._train_support import make_student_config, precompute_cache

REPO = Path(loop.__file__).resolve().parents[2]  # the checkout whose stages/ and pipeline/ are kdcache
SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")  # every way a tensor's value reaches the host


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("step")
    teacher = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=32,
                             extra=("--features", "hidden,logits", "--top-k", "8"))
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    return {"root": root, "cache": cache, "student": student}


def _options(setup: dict[str, Path], out: str, **kw: object) -> TrainOptions:
    base = dict(cache=str(setup["cache"]), student=str(setup["student"]), out=str(setup["root"] / out),
                batch_size=4, lr=3e-3, log_every=4, max_steps=8, zero_stage=0)
    base.update(kw)
    return TrainOptions.of(**base)  # type: ignore[arg-type]


class SyncCounter:
    """Counts the host reads of tensor values made by kdcache's own code inside ``_Trainer._micro_step``, from the
    second micro-step on (the first runs the one-off checks of the student); records ``file:line`` of each."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside, self.micro_steps, self.calls = False, 0, []  # type: ignore[var-annotated]
        for name in SYNCS:
            monkeypatch.setattr(torch.Tensor, name, self._counting(getattr(torch.Tensor, name)))
        original = loop._Trainer._micro_step

        def micro_step(trainer: loop._Trainer, *args: object) -> None:
            self.inside = self.micro_steps > 0
            try:
                original(trainer, *args)  # type: ignore[arg-type]
            finally:
                self.inside, self.micro_steps = False, self.micro_steps + 1
        monkeypatch.setattr(loop._Trainer, "_micro_step", micro_step)

    def _counting(self, method):  # type: ignore[no-untyped-def]
        def counted(tensor: torch.Tensor, *args: object):  # type: ignore[no-untyped-def]
            if self.inside:
                caller = sys._getframe(1)
                path = Path(caller.f_code.co_filename)
                if path.is_relative_to(REPO) and path.parts[len(REPO.parts)] in ("stages", "pipeline", "storage"):
                    self.calls.append(f"{path.relative_to(REPO)}:{caller.f_lineno}")
            return method(tensor, *args)
        return counted


@pytest.fixture
def counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    yield SyncCounter(monkeypatch)


def test_the_step_reads_nothing_back_between_log_steps(setup: dict[str, Path], counter: SyncCounter) -> None:
    """CE + top-k KL + hidden MSE (the default run): 0 host reads in 7 micro-steps."""
    summary = run_training(_options(setup, "nosync", export=False))
    assert counter.micro_steps == 8 and summary["steps"] == 8
    assert counter.calls == []
    records = read_jsonl(setup["root"] / "nosync" / "metrics.jsonl")
    assert [r["step"] for r in records] == [4, 8] and all(r["tokens"] > 0 for r in records)
    assert summary["tokens_per_s"] > 0


def test_the_counter_sees_a_sync_when_there_is_one(setup: dict[str, Path], counter: SyncCounter) -> None:
    """--trace-samples reads the loss every micro-step (its help says so): the counter must see it."""
    run_training(_options(setup, "traced", export=False, trace_samples=True, max_steps=2))
    assert any(call.startswith("stages/train/loop.py") for call in counter.calls)
