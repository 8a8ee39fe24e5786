"""Issue 61's smaller findings at the command line: no flag abbreviations, and what a command says about what it
was given (a training cache scored by ``eval``, a cache difference listed once by ``precompute``)."""

from __future__ import annotations

import ast
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
