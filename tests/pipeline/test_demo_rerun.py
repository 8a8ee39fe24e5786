"""A second ``kdcache demo`` into the same folder (issue 53): it stopped at step 3/6, since ``init-student`` refuses a
folder that holds a student, and ``make clean`` was the only way to start over (it deletes ``.venv`` too).

The decisions are tested here on folders written by hand, the way the steps leave them; the whole rerun in
``test_cli.py``, on the first demo that module runs anyway.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from kdcache.pipeline.demo_reuse import StepLog, cache_id, finished_run, has_eval, matching_student, set_aside

REPO = Path(__file__).resolve().parents[2]


def _student(folder: Path, teacher: str, blocks: list[int], *, weights: bool = True) -> Path:
    """A folder as ``init-student`` leaves it: config, weights, then its record, written last."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    (folder / "kdcache_init.json").write_text(json.dumps({"teacher": teacher, "teacher_blocks": blocks}))
    return folder


def test_a_student_is_reused_only_when_built_from_the_same_teacher_and_blocks(tmp_path: Path) -> None:
    teacher = tmp_path / "minilm"
    built = _student(tmp_path / "s", str(teacher), [2, 4, 6])
    assert matching_student(built, teacher, [2, 4, 6])
    assert not matching_student(built, teacher, [1, 3, 5])  # other blocks
    assert not matching_student(built, tmp_path / "other", [2, 4, 6])  # another teacher
    assert not matching_student(_student(tmp_path / "half", str(teacher), [2, 4, 6], weights=False), teacher, [2, 4, 6])
    assert not matching_student(tmp_path / "none", teacher, [2, 4, 6])
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "kdcache_init.json").write_text("[not a record")
    assert not matching_student(tmp_path / "bad", teacher, [2, 4, 6])


def test_step_measurements_are_kept_with_the_arguments_they_ran_with(tmp_path: Path) -> None:
    log = StepLog.open(tmp_path)
    assert log.measured("train", ["--max-steps", "6"]) is None
    log.record("train", ["--max-steps", "6"], 12.5, 1 << 30)
    again = StepLog.open(tmp_path)  # read back from the file, as a second demo does
    assert again.measured("train", ["--max-steps", "6"]) == (12.5, 1 << 30)
    assert again.measured("train", ["--max-steps", "7"]) is None  # other settings: measured again
    (tmp_path / "steps.json").write_text("{half a file")
    assert StepLog.open(tmp_path).measured("train", ["--max-steps", "6"]) is None


def test_only_a_run_that_exported_its_student_counts_as_finished(tmp_path: Path) -> None:
    """The export writes the config, then the weights, then projectors.pt: a run stopped before the last is not
    finished."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    assert not finished_run(run)  # stopped mid-training: trained again
    (run / "student").mkdir()
    (run / "student" / "config.json").write_text("{}")
    assert not finished_run(run)  # stopped in save_pretrained, before the weights
    (run / "student" / "model.safetensors").write_bytes(b"\0" * 8)
    assert not finished_run(run)  # stopped before the projectors
    (run / "projectors.pt").write_bytes(b"\0")
    assert finished_run(run)


def test_a_step_record_is_forgotten_before_the_step_runs_again(tmp_path: Path) -> None:
    log = StepLog.open(tmp_path)
    log.record("train", ["--max-steps", "6"], 12.5, 1 << 30)
    log.forget("train")
    assert StepLog.open(tmp_path).measured("train", ["--max-steps", "6"]) is None


def test_a_cache_is_named_by_its_fingerprints(tmp_path: Path) -> None:
    """Two caches in the same folder, made with other settings, get other ids (a trained run's record names the
    id of the cache it read); a folder without a manifest gets none."""
    cache = tmp_path / "cache"
    cache.mkdir()
    assert cache_id(cache) == ""
    (cache / "manifest.json").write_text(json.dumps({"fingerprints": {"settings": {"max_length": 64}}}))
    first = cache_id(cache)
    (cache / "manifest.json").write_text(json.dumps({"fingerprints": {"settings": {"max_length": 128}}}))
    assert first.startswith("cache-") and cache_id(cache).startswith("cache-") and cache_id(cache) != first


def test_make_demo_clean_removes_the_demo_outputs_and_keeps_the_environment(tmp_path: Path) -> None:
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text("")
    (tmp_path / "demo-out" / "cache").mkdir(parents=True)
    done = subprocess.run(["make", "-f", str(REPO / "Makefile"), "demo-clean"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "demo-out").exists() and (tmp_path / ".venv" / "bin" / "python").is_file()
    readme = (REPO / "README.md").read_text()
    assert "make demo-clean" in readme and "make clean" in readme


def test_a_run_the_new_settings_cannot_reuse_is_kept_beside_it_under_a_new_name(tmp_path: Path) -> None:
    """Issue 61: a demo with other settings deleted the earlier run; now it is renamed, each time to a free name."""
    run = tmp_path / "run"
    (run / "student").mkdir(parents=True)
    (run / "student" / "model.safetensors").write_bytes(b"\1" * 8)
    (run / "metrics.jsonl").write_text('{"step": 150}\n')
    assert set_aside(run) == tmp_path / "run-earlier-1" and not run.exists()
    assert (tmp_path / "run-earlier-1" / "student" / "model.safetensors").read_bytes() == b"\1" * 8
    run.mkdir()
    assert set_aside(run) == tmp_path / "run-earlier-2" and (tmp_path / "run-earlier-1" / "metrics.jsonl").is_file()


def test_a_demo_with_other_sentences_keeps_the_earlier_data_file_and_its_cache(tmp_path: Path) -> None:
    """Issue 61: other --train-sentences rewrote data/train.jsonl under the cache made from it; now both are kept
    beside the new ones, and the same settings again keep everything where it is."""
    from kdcache.pipeline.demo import DemoOptions, prepare_data

    train, _ = prepare_data(DemoOptions(train_sentences=5, heldout_sentences=3), tmp_path)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "manifest.json").write_text("{}")
    earlier = train.read_text()
    prepare_data(DemoOptions(train_sentences=6, heldout_sentences=3), tmp_path)
    assert (tmp_path / "data" / "train-earlier-1.jsonl").read_text() == earlier
    assert (tmp_path / "cache-earlier-1" / "manifest.json").is_file() and not (tmp_path / "cache").exists()
    assert len(train.read_text().splitlines()) == 6
    assert (tmp_path / "data" / "heldout-earlier-1.jsonl").is_file()  # its sentences moved on by one too
    prepare_data(DemoOptions(train_sentences=6, heldout_sentences=3), tmp_path)
    assert not (tmp_path / "data" / "train-earlier-2.jsonl").exists()


def test_a_copied_demo_folder_finds_its_steps_and_evaluations(tmp_path: Path) -> None:
    """Issue 61: a demo folder copied elsewhere reran every step: its records named the old folder."""
    here, there = tmp_path / "here", tmp_path / "there"
    StepLog.open(here / "logs").record("train", ["--out", str(here / "run")], 12.5, 1 << 30)
    cache = here / "cache-heldout"
    cache.mkdir(parents=True)
    (cache / "manifest.json").write_text(json.dumps({"fingerprints": {"settings": {"max_length": 64}}}))
    (here / "run" / "evals").mkdir(parents=True)
    record = {"role": "baseline", "cache": {"path": str(cache), "label": cache_id(cache)}}
    (here / "run" / "evals" / f"baseline@{cache_id(cache)}.json").write_text(json.dumps(record))
    shutil.copytree(here, there)
    assert StepLog.open(there / "logs").measured("train", ["--out", str(there / "run")]) == (12.5, 1 << 30)
    assert has_eval(there / "run", "baseline", there / "cache-heldout")
    assert not has_eval(there / "run", "trained", there / "cache-heldout")
    (there / "cache-heldout" / "manifest.json").write_text(json.dumps({"fingerprints": {"settings": {}}}))
    assert not has_eval(there / "run", "baseline", there / "cache-heldout")  # another cache under that name
    # a record written before the folder was written OUT still counts where it was written
    (here / "logs" / "steps.json").write_text(json.dumps(
        {"train": {"args": ["--out", str(here / "run")], "seconds": 1.0, "peak_rss": 1}}))
    assert StepLog.open(here / "logs").measured("train", ["--out", str(here / "run")]) == (1.0, 1)
