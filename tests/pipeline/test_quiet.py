"""``--quiet``: a command that succeeds prints nothing at all, its libraries' lines included."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.pipeline.children import child_env
from kdcache.pipeline.cli import main
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def _kdcache(*argv: str) -> subprocess.CompletedProcess[str]:
    env = child_env(HF_HUB_OFFLINE="1")  # no rank variables from a training test run earlier in this process
    return subprocess.run([sys.executable, "-m", "kdcache", *argv], capture_output=True, text=True, env=env,
                          timeout=600)


def test_quiet_precompute_in_process_prints_nothing(tiny_gpt2: Path, tmp_path: Path,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(12))
    capfd.readouterr()
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(tmp_path / "c"),
                 "--layers", "1,3", "--quiet"]) == 0
    assert capfd.readouterr() == ("", "")
    assert (tmp_path / "c" / "manifest.json").is_file()  # quiet, not idle
    # A failure still speaks, on stderr, after the quiet block.
    assert main(["precompute", "--teacher", str(tmp_path / "nowhere"), "--data", str(data), "--out",
                 str(tmp_path / "d"), "--quiet"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and "does not exist" in err


@pytest.mark.slow
def test_quiet_precompute_train_eval_print_nothing(tiny_gpt2: Path, tmp_path: Path) -> None:
    """Three commands as a user runs them, each in its own process: stdout and stderr stay empty."""
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(24))
    cache, run = tmp_path / "cache", tmp_path / "run"
    commands = [
        ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache), "--layers", "1,3"],
        ["init-student", "--teacher", str(tiny_gpt2), "--layers", "1,3", "--out", str(tmp_path / "s")],
        ["train", "--cache", str(cache), "--student", str(tmp_path / "s"), "--out", str(run), "--max-steps", "2",
         "--batch-size", "4"],
        ["eval", "--cache", str(cache), "--run", str(run)],
    ]
    for argv in commands:
        proc = _kdcache(*argv, "--quiet")
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", ""), argv
    assert (run / "student" / "config.json").is_file() and list((run / "evals").glob("trained@*.json"))


def test_quiet_keeps_kdcache_notes_on_stderr_and_drops_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.pipeline.quiet import quiet

    with quiet():
        print("a summary line")
        print("kdcache train: note: cached targets this run leaves unused: hidden layers 2", file=sys.stderr)
        sys.stderr.write("\rprecompute:  50%|#####     | 1/2")  # a bar redrawn in place, then ended
        sys.stderr.write("\rprecompute: 100%|##########| 2/2\n")
        sys.stderr.write("kdcache train: ")  # a note written in pieces
        sys.stderr.write("teacher head from the cache\n")
    out, err = capsys.readouterr()
    assert out == "" and err == ("kdcache train: note: cached targets this run leaves unused: hidden layers 2\n"
                                 "kdcache train: teacher head from the cache\n")


# kdcache's own stdout lines: precompute's, init-student's and train's summaries (nothing else goes to stdout).
OWN_STDOUT = re.compile(r"^(cache |this run: |bytes/token: |student with teacher blocks |trained \d+ steps |"
                        r"run dir |student  )")
LIBRARY_NOISE = ("DeepSpeed", "Setting accelerator", "built successfully", "\r", "it/s]", "Loading weights",
                 "Generating train split", "Writing model shards", "Warning", "warnings.warn")


@pytest.mark.slow
def test_a_log_holds_only_kdcache_lines_with_or_without_quiet(tiny_gpt2: Path, tmp_path: Path) -> None:
    """Issue 32: with stdout and stderr piped to a log (no terminal), stdout holds only kdcache's summaries and
    stderr only kdcache's lines: no DeepSpeed banner, no library progress bar, no warning from our code (a q/k
    cache runs the probe that once warned about a read-only NumPy array)."""
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(24))
    for quiet_flag in ((), ("--quiet",)):
        root = tmp_path / ("quiet" if quiet_flag else "plain")
        cache, run = root / "cache", root / "run"
        commands = [
            ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache), "--layers", "1,3",
             "--features", "hidden,attention,logits", "--attention-source", "qk"],
            ["init-student", "--teacher", str(tiny_gpt2), "--layers", "1,3", "--out", str(root / "s")],
            ["train", "--cache", str(cache), "--student", str(root / "s"), "--out", str(run), "--max-steps", "2",
             "--batch-size", "4", "--delta", "1"],
        ]
        for argv in commands:
            proc = _kdcache(*argv, *quiet_flag)
            assert proc.returncode == 0, proc.stderr[-3000:]
            if quiet_flag:
                assert (proc.stdout, proc.stderr) == ("", ""), argv
            stray = [line for line in proc.stdout.splitlines() if not OWN_STDOUT.match(line)]
            assert not stray, (argv, stray)
            assert not [line for line in proc.stderr.splitlines() if not line.startswith("kdcache ")], \
                (argv, proc.stderr[-2000:])
            assert not [n for n in LIBRARY_NOISE if n in proc.stdout + proc.stderr], (argv, proc.stderr[-2000:])
