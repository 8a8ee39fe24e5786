"""Caches written before format 3 still train: the format-1 caches in tests/data, through ``kdcache train``."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.logging import read_jsonl

FORMAT1 = Path(__file__).resolve().parents[1] / "data" / "format1"


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
def test_a_format1_cache_still_trains(backend: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    shutil.copytree(FORMAT1 / f"cache-{backend}", cache)  # the committed copy stays untouched
    out = tmp_path / "run"
    argv = ["train", "--cache", str(cache), "--student", str(FORMAT1 / "student"), "--out", str(out),
            "--zero-stage", "0", "--max-steps", "3", "--batch-size", "4", "--delta", "1", "--log-every", "1"]
    assert main(argv) == 0
    losses = [row["loss"] for row in read_jsonl(out / "metrics.jsonl")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
