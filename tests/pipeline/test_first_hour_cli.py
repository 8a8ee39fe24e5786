"""Issue 61's smaller findings about the command line and the README: no flag abbreviations, the README's note on
disk use, and its skipped tests named by their reason. (The others are tested beside their code: eval's note on a
training cache in tests/stages/train/test_run_identity.py, a difference listed once in
tests/stages/precompute/test_cache_is_its_content.py, the demo's echo in tests/pipeline/test_cli.py, zarr's exit in
tests/storage/test_zarr_exit.py, the architecture notes in tests/test_import_cycles.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_an_abbreviated_flag_is_refused_with_the_flag_it_resembles(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``--max-step 3`` was taken for ``--max-steps 3``; argparse's prefix matching is off, so it is an error that
    names the whole flag (exit 2, no traceback)."""
    argv = ["train", "--cache", str(tmp_path / "c"), "--student", str(tmp_path / "s"), "--out", str(tmp_path / "r"),
            "--max-step", "3"]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "unrecognized arguments: --max-step 3" in err and "did you mean --max-steps?" in err
    assert "Traceback" not in err


def _parsers_allowing_abbreviations(source: str) -> list[int]:
    """Lines of ``ArgumentParser(...)`` calls in ``source`` that do not pass ``allow_abbrev=False``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "ArgumentParser":
            off = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                      for k in node.keywords)
            lines += [] if off else [node.lineno]
    return lines


def test_every_parser_the_project_builds_turns_abbreviations_off() -> None:
    assert _parsers_allowing_abbreviations("import argparse\np = argparse.ArgumentParser(add_help=False)\n") == [2]
    found = {str(path.relative_to(ROOT)): lines for folder in ("pipeline", "stages", "storage", "benchmarks")
             for path in sorted((ROOT / folder).rglob("*.py"))
             if (lines := _parsers_allowing_abbreviations(path.read_text()))}
    assert found == {}


def test_the_readme_says_what_the_disk_holds_and_why_a_checkpoint_is_three_students() -> None:
    """Issue 61: the README did not mention disk use (the demo leaves ~588 MB; a checkpoint is ~204 MiB for a 66 MiB
    student). Its reason, weights plus AdamW's two moments, is what the code's estimate counts."""
    from torch import nn

    from kdcache.stages.train.checkpoint import estimate_bytes

    readme = (ROOT / "README.md").read_text()
    note = readme[readme.index("**Disk use.**"):]
    note = note[:note.index("\n\n")]
    for words in ("588 MB", "204 MiB", "three times", "AdamW's two", "--save-every 0", "RUN/checkpoints/",
                  "make demo-clean"):
        assert words in note, words
    student = nn.Linear(384, 384)  # fp32, trainable
    weights = sum(p.numel() * 4 for p in student.parameters())
    assert estimate_bytes(student, half_precision=False) == 3 * weights


def test_the_readme_names_the_skipped_tests_by_their_reason() -> None:
    """Issue 61: "42 CUDA-only" skips were 40 CUDA skips and the 2 zarr-layout checks the Arrow caches skip."""
    readme = (ROOT / "README.md").read_text()
    assert "42 of them CUDA-only" not in readme
    # the counts change with each round's tests; the reasons stay named
    assert re.search(r"\b\d+ of them skipped here: \d+ need CUDA, 2 check the zarr layout and skip for Arrow caches",
                     readme)
    suite = (ROOT / "tests" / "storage" / "_format3_suite.py").read_text()
    assert suite.count('pytest.skip("zarr') == 2
