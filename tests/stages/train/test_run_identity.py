"""A run's options are its identity (issue 61): ``--resume`` refuses a changed loss, map or data option and leaves
the run folder byte for byte as it was; it accepts what cannot change the result, and a moved run and cache;
``--init-from RUN`` starts a new run from RUN's student and says so in its record.

One short ZeRO-0 run is trained once for the module; the refused resume starts no DeepSpeed engine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.logging import read_jsonl
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, precompute_cache

STEPS = 2


def _train(cache: Path, out: Path, *extra: str, student: Path | None = None) -> int:
    argv = ["train", "--cache", str(cache), "--out", str(out), "--batch-size", "4", "--lr", "3e-3", "--log-every",
            "1", "--beta", "0", *(["--student", str(student)] if student else []), *extra]
    return main(argv)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("identity")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    cache = precompute_cache(teacher, root / "cache", num_sequences=16, extra=("--features", "hidden"))
    student = make_student_config(root / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    run = root / "run"
    assert _train(cache, run, "--max-steps", str(STEPS), student=student) == 0
    return {"root": root, "cache": cache, "student": student, "run": run}


def _folder_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_resume_with_a_changed_loss_option_exits_2_naming_it_and_leaves_the_run_unchanged(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run = setup["run"]
    before = _folder_hashes(run)
    code = _train(setup["cache"], run, "--resume", "--max-steps", "4", "--hidden-loss", "cosine", "--gamma", "2",
                  student=setup["student"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert '--hidden-loss: "mse" in the run, "cosine" now' in err and '--gamma: 1.0 in the run, 2.0 now' in err
    assert "2 changed" in err and f"--init-from {run}" in err
    assert _folder_hashes(run) == before  # byte for byte: options.json still says mse


def test_resume_asking_fewer_steps_than_the_checkpoint_holds_exits_2_and_leaves_the_run_unchanged(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    run = setup["run"]
    before = _folder_hashes(run)
    assert _train(setup["cache"], run, "--resume", "--max-steps", "1", student=setup["student"]) == 2
    err = capsys.readouterr().err
    assert f"would end at step 1 (--max-steps or --epochs), before its checkpoint's step {STEPS}" in err
    assert "Traceback" not in err and _folder_hashes(run) == before


def test_a_new_run_into_a_finished_runs_folder_is_refused_and_changes_nothing(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """What `kdcache run` and `kdcache sweep` rely on too: training without --resume never replaces a run."""
    run = setup["run"]
    before = _folder_hashes(run)
    assert _train(setup["cache"], run, "--max-steps", "1", "--hidden-loss", "cosine", student=setup["student"]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert _folder_hashes(run) == before


def test_a_moved_run_and_cache_resume_with_a_longer_run_and_other_logging(setup: dict[str, Path]) -> None:
    """The cache counts by its fingerprints, not its path; --max-steps and --log-every cannot change the result."""
    root = setup["root"]
    moved_run, moved_cache = root / "moved-run", root / "moved-cache"
    shutil.copytree(setup["run"], moved_run)
    shutil.copytree(setup["cache"], moved_cache)
    assert _train(moved_cache, moved_run, "--resume", "--max-steps", "3", "--log-every", "3",
                  student=setup["student"]) == 0
    assert [r["step"] for r in read_jsonl(moved_run / "metrics.jsonl")] == [1, 2, 3]
    assert json.loads((moved_run / "options.json").read_text())["hidden_loss"] == "mse"


def test_init_from_starts_a_new_run_from_the_old_student_and_records_it(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    new = setup["root"] / "cosine"
    # A learning rate of 1e-12 moves no weight by more than ~1e-12: the new student is the old one.
    assert _train(setup["cache"], new, "--init-from", str(setup["run"]), "--hidden-loss", "cosine", "--max-steps",
                  "1", "--lr", "1e-12") == 0
    assert "projector tensors from its projectors.pt" in capsys.readouterr().err
    plan, options = (json.loads((new / name).read_text()) for name in ("plan.json", "options.json"))
    assert plan["init_from"]["run"] == str(setup["run"].resolve()) and plan["init_from"]["steps"] == STEPS
    assert plan["init_from"]["options"]["hidden_loss"] == "mse" and options["hidden_loss"] == "cosine"
    assert options["init_from"] == str(setup["run"]) and options["student"] == str(setup["run"] / "student")
    from safetensors.torch import load_file

    old, fresh = (load_file(str(r / "student" / "model.safetensors")) for r in (setup["run"], new))
    assert all(torch.allclose(fresh[k].double(), old[k].double(), atol=1e-9) for k in old)


def test_init_from_a_run_without_an_exported_student_is_refused(setup: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    code = _train(setup["cache"], setup["root"] / "x", "--init-from", str(setup["root"] / "cache"))
    err = capsys.readouterr().err
    assert code == 2 and "holds no exported student" in err and "Traceback" not in err


def test_eval_on_the_runs_own_training_cache_says_it_scores_training_data(
        setup: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 61: `eval` on the cache the run trained on gave no word that the scores are not held out; a copy of
    that cache is the same cache, and another cache gets no note."""
    other = precompute_cache(setup["root"] / "teacher", setup["root"] / "other", num_sequences=8,
                             extra=("--features", "hidden"))
    copy = setup["root"] / "copied-cache"
    shutil.copytree(setup["cache"], copy)
    outputs = {}
    for name, cache in (("own", setup["cache"]), ("copy", copy), ("other", other)):
        capsys.readouterr()
        assert main(["eval", "--cache", str(cache), "--run", str(setup["run"])]) == 0
        outputs[name] = capsys.readouterr().out
    assert "is the cache this run trained on: these scores are on its training data" in outputs["own"]
    assert "is the cache this run trained on" in outputs["copy"]
    assert "trained on" not in outputs["other"]


def test_a_run_recorded_before_the_cache_hash_compares_the_cache_path_and_its_options(tmp_path: Path) -> None:
    """An older run's options.json has no init_from and its plan.json no cache_hash: options it predates count at
    their default, and its cache at its path (written another way, the same folder)."""
    from kdcache.stages.train.checkpoint import RunChangedError, check_resume
    from kdcache.stages.train.core.options import TrainOptions

    (tmp_path / "c").mkdir()
    options = TrainOptions.of(cache=str(tmp_path / "c"), student="s", out=str(tmp_path / "run"))
    record = {k: v for k, v in json.loads(json.dumps(options.to_dict())).items() if k != "init_from"}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "options.json").write_text(json.dumps(record))
    check_resume(tmp_path / "run", TrainOptions.of(cache=str(tmp_path / "x" / ".." / "c"), student="s",
                                                   out=str(tmp_path / "run"), max_steps=7), {})
    with pytest.raises(RunChangedError) as refused:
        check_resume(tmp_path / "run", TrainOptions.of(cache=str(tmp_path / "d"), student="s",
                                                       out=str(tmp_path / "run"), lr=1e-3), {})
    assert "--cache: " in str(refused.value) and "--lr: 0.0001 in the run, 0.001 now" in str(refused.value)
