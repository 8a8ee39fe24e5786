"""Caches written before format 3 still train: the format-1 caches in tests/data, through ``kdcache train``."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.logging import read_jsonl

FORMAT1 = Path(__file__).resolve().parents[2] / "data" / "format1"


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


FORMAT2_SEQ2SEQ = Path(__file__).resolve().parents[2] / "data" / "format2-seq2seq"


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
def test_a_format2_encoder_decoder_cache_still_reads_trains_and_evaluates(backend: str, tmp_path: Path) -> None:
    """tests/data/format2-seq2seq: written by the last format-2 writer (a tiny BART; see tests/data/README.md)."""
    from kdcache.stages.train.evaluation.eval_records import read_evals
    from kdcache.storage import CacheReader, verify_cache

    cache = tmp_path / "cache"
    shutil.copytree(FORMAT2_SEQ2SEQ / f"cache-{backend}", cache)
    reader = CacheReader(cache)
    assert reader.manifest.format_version == 2 and reader.spec.streams == ("encoder", "decoder")
    assert verify_cache(cache).ok
    out = tmp_path / "run"
    assert main(["train", "--cache", str(cache), "--student", str(FORMAT2_SEQ2SEQ / "student"), "--out", str(out),
                 "--zero-stage", "0", "--max-steps", "2", "--batch-size", "4", "--gamma", "1", "--delta", "1",
                 "--decoder-layer-map", "explicit:1-2", "--encoder-layer-map", "explicit:1-2", "--quiet"]) == 0
    record = read_jsonl(out / "metrics.jsonl")[-1]
    assert all(math.isfinite(record[k]) for k in ("loss", "encoder/hidden", "decoder/hidden", "cross_attention"))
    assert main(["eval", "--cache", str(cache), "--run", str(out)]) == 0
    assert read_evals(out)[0]["kind"] == "encoder_decoder_lm"
