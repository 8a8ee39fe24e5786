"""What a training run tells its user while it runs: progress lines, and trackers through DeepSpeed's monitor
(TensorBoard event files read back with TensorBoard's own reader, CSV files), or nothing with ``--quiet``."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from tests.stages.train._train_support import make_student_config, write_cache

STEPS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.helpers.tiny_models import make_tiny_gpt2

    root = tmp_path_factory.mktemp("reporting")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=16, heads=2)
    cache = write_cache(teacher, root / "cache", num_sequences=16)
    student = make_student_config(root / "student", teacher, n_layer=1, n_embd=16, n_head=2)
    shutil.rmtree(teacher)
    return {"root": root, "cache": cache, "student": student}


def _train(setup: dict[str, Path], out: str, *extra: str) -> int:
    return main(["train", "--cache", str(setup["cache"]), "--student", str(setup["student"]), "--out",
                 str(setup["root"] / out), "--max-steps", str(STEPS), "--batch-size", "4", "--log-every", "2",
                 "--zero-stage", "0", *extra])


def test_progress_lines_and_trackers(setup: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert _train(setup, "tracked", "--report-to", "tensorboard,csv") == 0
    err = capsys.readouterr().err
    assert "cached targets this run leaves unused: hidden layers 0, 1 (the layer map 'uniform' pairs no " in err
    assert "attention layers 1, 2 (--delta is 0: set --delta > 0 to distil attention maps)" in err
    lines = [line for line in err.splitlines() if line.startswith("kdcache train: step")]
    assert [line.split()[3] for line in lines] == ["2/4", "4/4"]  # not a terminal: one line per logged step
    assert all("loss" in line and "tok/s" in line and "data wait" in line and "eta" in line for line in lines)
    events = EventAccumulator(str(setup["root"] / "tracked" / "tensorboard"))
    events.Reload()
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == [2, 4] and all(e.value > 0 for e in losses)
    assert "train/data_wait_s" in events.Tags()["scalars"]
    with open(setup["root"] / "tracked" / "csv" / "train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert [row[0] for row in rows[1:]] == ["2", "4"]


def test_quiet_prints_no_progress(setup: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    assert _train(setup, "quiet", "--quiet") == 0
    assert "kdcache train: step" not in capsys.readouterr().err
    assert not (setup["root"] / "quiet" / "tensorboard").exists()  # no tracker unless asked


@pytest.mark.parametrize("trackers, message", [("tensorboard,mlflow", "report_to 'mlflow' is not a tracker"),
                                               ("wandb", 'pip install "kdcache[wandb]"')])
def test_bad_trackers_exit_2(setup: dict[str, Path], capsys: pytest.CaptureFixture, trackers: str,
                             message: str) -> None:
    pytest.importorskip("tensorboard")
    if trackers == "wandb" and __import__("importlib").util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    assert _train(setup, "bad", "--report-to", trackers) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_terminal_gets_a_bar_with_the_same_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setenv("COLUMNS", "200")  # a wide terminal, whatever runs the test (a worker has none of its own)

    from kdcache.stages.train.logging import TrainProgress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    progress = TrainProgress(10, 4, enabled=True, stream=screen)  # a run resumed at step 4
    progress.update(6, {"loss": 2.5, "ce": 2.0, "kl": 0.5}, 0.25, tokens=2048)
    progress.close()
    text = screen.getvalue()
    assert "6/10" in text and "loss 2.5 (ce 2, kl 0.5)" in text and "tok/s" in text and "data wait 25%" in text


def test_each_line_shows_every_loss_term_in_one_order_and_metrics_apart() -> None:
    """A term that grows past another keeps its place; a small one is not dropped; aligned_share is no loss."""
    from kdcache.stages.train.logging import describe

    first = describe({"loss": 3.0, "ce": 2.0, "gold": 0.6, "hidden": 0.3, "attention": 0.1, "aligned_share": 0.9,
                      "hidden/s1_t2": 0.3}, 100.0, 0.0)
    later = describe({"loss": 3.0, "ce": 0.5, "gold": 2.0, "hidden": 0.4, "attention": 0.1, "aligned_share": 0.95,
                      "hidden/s1_t2": 0.4}, 100.0, 0.0)
    assert first.startswith("loss 3 (attention 0.1, ce 2, gold 0.6, hidden 0.3) | aligned share 0.9 |"), first
    assert later.startswith("loss 3 (attention 0.1, ce 0.5, gold 2, hidden 0.4) | aligned share 0.95 |"), later
