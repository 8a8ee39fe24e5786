"""``kdcache sweep``: grid parsing and validation, run bookkeeping, and a real sweep from one cache.

The bookkeeping tests start a stand-in trainer through ``--launcher`` (a few lines of Python that writes what a
run writes, or fails on demand), so they take seconds; one slow test runs real trainings of tiny models.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.pipeline.sweep import parse_grid, run_name, same_run, split_values
from kdcache.stages.train.evaluation.eval_records import read_evals

FAKE_TRAIN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    args = sys.argv[sys.argv.index("train") + 1:]
    opts = dict(zip(args[::2], args[1::2]))
    out = Path(opts["--out"])
    if "explicit" in opts.get("--layer-map", ""):
        print("training cannot start: the cache lacks teacher layer 9", file=sys.stderr)
        sys.exit(2)
    (out / "student").mkdir(parents=True, exist_ok=True)
    (out / "student" / "config.json").write_text("{}")
    (out / "options.json").write_text(json.dumps({"cache": opts["--cache"]}))
    (out / "plan.json").write_text(json.dumps({"total_steps": 2, "hidden_pairs": [[1, 2]]}))
    loss = 1.0 if opts.get("--hidden-loss") == "cka" else 2.0
    with open(out / "metrics.jsonl", "w") as fh:
        for step in (1, 2):
            fh.write(json.dumps({"step": step, "loss": loss / step, "hidden": loss / step,
                                 "hidden/s1_t2": loss / step, "lr": 0.1}) + "\\n")
    with open(out.parent.parent / "calls.txt", "a") as fh:
        fh.write(out.name + "\\n")
""")


def test_split_values_keeps_explicit_maps_whole() -> None:
    assert split_values("uniform,explicit:1-2,2-4,none") == ["uniform", "explicit:1-2,2-4", "none"]
    assert split_values("0.1, 1.0") == ["0.1", "1.0"]
    assert split_values('["explicit:1-2", "reverse"]') == ["explicit:1-2", "reverse"]
    assert run_name({"layer_map": "explicit:1-2,2-4", "gamma": "0.1"}) == "layer_map-explicit_1-2_2-4__gamma-0.1"


def test_a_recorded_command_is_the_same_run_whatever_its_flag_order_or_map_spelling(tmp_path: Path) -> None:
    head = [sys.executable, "-m", "kdcache", "train"]
    now = [*head, "--cache", "c", "--student", str(tmp_path), "--out", "o", "--gamma", "0.5", "--layer-map", "last"]
    older = [*head, "--student", str(tmp_path), "--layer-map", "last-k", "--out", "o", "--cache", "c", "--gamma", ".5"]
    assert same_run(older, now) and same_run(now, now) and not same_run(None, now)
    assert not same_run([*older[:-1], "1"], now)  # another gamma
    assert not same_run(["torchrun", *older[1:]], now)  # another launcher


def test_parse_grid_reports_every_bad_item() -> None:
    grid, problems = parse_grid(["layer_map=uniform,reverse", "colour=red", "out=a,b", "layer_map=none", "gamma"])
    assert grid == {"layer_map": ["uniform", "reverse"]}
    assert len(problems) == 4
    assert "'colour' is not a train option" in problems[0] and "cannot vary" in problems[1]
    assert "given twice" in problems[2] and "expected KEY=V1,V2" in problems[3]


def test_bad_grid_exits_2_listing_every_problem_before_any_run(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    student = tmp_path / "student"
    student.mkdir()
    code = main(["sweep", "--cache", str(tmp_path / "cache"), "--student", str(student), "--out",
                 str(tmp_path / "sweep"), "--grid", "layer_map=uniform,sideways", "--grid", "hidden_loss=mse,l7",
                 "--grid", "colour=red", "--grid", "lr=0.1,-1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    for needle in ("'colour' is not a train option", "unknown map 'sideways'", "got 'l7', expected one of",
                   "lr must be > 0", "grid point(s): layer_map-sideways"):
        assert needle in err, needle
    assert not (tmp_path / "sweep").exists()


def test_dry_run_prints_one_command_per_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    student = tmp_path / "student"
    student.mkdir()
    code = main(["sweep", "--cache", "c", "--student", str(student), "--out", str(tmp_path / "sweep"), "--dry-run",
                 "--grid", "layer_map=uniform,explicit:1-2,2-4", "--grid", "gamma=0.5,1", "--launcher",
                 "torchrun --nproc_per_node 8", "--max-steps", "7"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(lines) == 4
    assert lines[2].startswith("layer_map-explicit_1-2_2-4__gamma-0.5: torchrun --nproc_per_node 8 -m kdcache "
                               "train --cache c")
    assert "--layer-map explicit:1-2,2-4" in lines[2] and "--gamma 0.5" in lines[2] and "--max-steps 7" in lines[2]


def _fake_sweep(tmp_path: Path) -> tuple[list[str], Path]:
    fake = tmp_path / "fake_train.py"
    fake.write_text(FAKE_TRAIN)
    student = tmp_path / "student"
    student.mkdir(exist_ok=True)
    sweep = tmp_path / "sweep"
    argv = ["sweep", "--cache", str(tmp_path / "cache"), "--student", str(student), "--out", str(sweep),
            "--launcher", f"{sys.executable} {fake}", "--grid", "layer_map=uniform,explicit:1-9",
            "--grid", "hidden_loss=mse,cka"]
    return argv, sweep


def test_a_failing_point_is_recorded_and_the_others_finish(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    argv, sweep = _fake_sweep(tmp_path)
    assert main(argv) == 1  # some run failed
    with open(sweep / "results.csv") as fh:
        rows = {r["name"]: r for r in csv.DictReader(fh)}
    assert [r["status"] for r in rows.values()] == ["ok", "ok", "failed", "failed"]
    assert rows["layer_map-uniform__hidden_loss-cka"]["loss"] == "0.5"
    assert rows["layer_map-uniform__hidden_loss-mse"]["hidden/s1_t2"] == "1.0"
    summary = json.loads((sweep / "sweep.json").read_text())
    failed = summary["runs"][2]
    assert failed["returncode"] == 2 and "lacks teacher layer 9" in failed["log_tail"]
    md = (sweep / "results.md").read_text()
    assert "| layer_map-explicit_1-9__hidden_loss-mse | explicit:1-9 | mse | failed |" in md
    assert "hidden/s1_t2" not in md  # per-pair terms only in the CSV
    # A rerun reuses the finished points and retries the failed ones.
    calls = (sweep / "calls.txt").read_text().split()
    assert main(argv) == 1
    assert (sweep / "calls.txt").read_text().split() == calls
    assert [r["status"] for r in json.loads((sweep / "sweep.json").read_text())["runs"]][:2] == ["reused"] * 2
    # The same folder with other options is refused before anything runs.
    (sweep / "runs" / "layer_map-uniform__hidden_loss-mse" / "checkpoints").mkdir()
    (sweep / "runs" / "layer_map-uniform__hidden_loss-mse" / "checkpoints" / "latest").write_text("step2")
    capsys.readouterr()
    assert main([*argv, "--lr", "0.5"]) == 2
    assert "holds a run trained with other options" in capsys.readouterr().err
    assert (sweep / "calls.txt").read_text().split() == calls


@pytest.mark.slow
def test_real_sweep_from_one_cache_with_eval_and_report(tmp_path: Path) -> None:
    """Tiny GPT-2 teacher, cached then deleted; 2 real trainings, 1 point failing its cache check; eval; report."""
    from tests.helpers.tiny_models import make_tiny_gpt2
    from tests.stages.train._train_support import make_student_config, write_cache

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=3, hidden=32, heads=4)
    cache = write_cache(teacher, tmp_path / "cache", num_sequences=24)
    heldout = write_cache(teacher, tmp_path / "heldout", num_sequences=12, seed=1, logits="full")
    student = make_student_config(tmp_path / "student", teacher, n_layer=2, n_embd=16, n_head=2)
    shutil.rmtree(teacher)  # a sweep never needs the teacher
    sweep = tmp_path / "sweep"
    code = main(["sweep", "--cache", str(cache), "--student", str(student), "--out", str(sweep), "--eval-cache",
                 str(heldout), "--grid", "layer_map=uniform,last,explicit:1-5", "--max-steps", "3",
                 "--batch-size", "4", "--log-every", "1"])
    assert code == 1
    with open(sweep / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"]
    for row in rows[:2]:
        assert row["steps"] == "3" and float(row["loss"]) > 0 and float(row["eval_perplexity"]) > 1
        assert 0 <= float(row["eval_top1"]) <= 1 and float(row["eval_kl"]) >= 0 and row["eval_cka_on_map"]
    [evaluation] = read_evals(sweep / "runs" / "layer_map-last")
    assert evaluation["kind"] == "causal_lm" and evaluation["cache"]["path"] == str(heldout.resolve())
    assert main(["report", str(sweep)]) == 0
    html = (sweep / "report" / "report.html").read_text()
    assert "layer_map-last" in html and "failed" in html and (sweep / "report" / "sweep_eval_perplexity.png").is_file()
