"""The README's section "A speculative-decoding draft from the same cache", run as written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kdcache.pipeline.children import child_env
from tests.helpers.tiny_models import make_tiny_llama, sample_texts

REPO = Path(__file__).resolve().parents[3]
HEADING = "## A speculative-decoding draft from the same cache"


def _console_lines() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text[text.index(HEADING):].split("```console\n", 1)[1].split("```", 1)[0]
    return [line[2:] for line in block.splitlines() if line.startswith("$ ")]


def test_readme_draft_walkthrough_runs_as_written(tmp_path: Path) -> None:
    make_tiny_llama(tmp_path / "target", layers=8, hidden=16, heads=2, kv_heads=1, intermediate=32)
    (tmp_path / "corpus.txt").write_text("\n".join(sample_texts(24)) + "\n")
    (tmp_path / "heldout.txt").write_text("\n".join(sample_texts(2, seed=4)) + "\n")
    lines = _console_lines()
    assert [line.split()[1] for line in lines] == ["precompute", "draft", "draft-eval"]
    env = child_env(HF_HUB_OFFLINE="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-c", "set -e\n" + "\n".join(lines)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "eagle3" / "config.json").is_file() and (tmp_path / "cache-draft" / "draft").is_dir()
    assert "EAGLE-3 head" in proc.stdout and "equals target: yes" in proc.stdout
    assert "equals target: NO" not in proc.stdout
