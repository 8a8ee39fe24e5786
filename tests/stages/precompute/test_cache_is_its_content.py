"""A cache is its content (issue 61): a copied or moved cache and data folder reruns, since the data's path and the
teacher's folder are labels beside the content hashes; other content is still refused, each difference named once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.storage import compare_fingerprints
from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts


def _precompute(teacher: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--max-length", "24",
            "--sequences-per-shard", "8", "--no-progress", "--features", "hidden", "--layers", "1,2", *extra]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("content")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    (root / "here" / "data").mkdir(parents=True)
    data = root / "here" / "data" / "texts.txt"
    data.write_text("\n".join(sample_texts(16)) + "\n")
    assert main(_precompute(teacher, data, root / "here" / "cache")) == 0
    return {"root": root, "teacher": teacher}


def test_a_copied_cache_and_data_folder_rerun_without_computing(first: dict[str, Path],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    root = first["root"]
    shutil.copytree(root / "here", root / "there")
    capsys.readouterr()
    assert main(_precompute(first["teacher"], root / "there" / "data" / "texts.txt", root / "there" / "cache",
                            "--json")) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["status"] == "complete" and summary["shards_written"] == 0  # reused: nothing recomputed


def test_other_content_at_a_moved_path_is_refused_naming_each_difference_once(
        first: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root = first["root"]
    shutil.copytree(root / "here", root / "other")
    (root / "other" / "data" / "texts.txt").write_text("\n".join(sample_texts(12)) + "\n")
    capsys.readouterr()
    assert main(_precompute(first["teacher"], root / "other" / "data" / "texts.txt", root / "other" / "cache")) == 2
    err = capsys.readouterr().err
    assert "data input_ids_hash differs" in err and "Traceback" not in err
    assert err.count("num_sequences") == 1  # the spec's count, which the data fingerprint's said again
    assert "data source" not in err  # the path is a label: the hashes say what differs


def test_precompute_into_a_cache_of_other_layers_lists_the_layers_once(first: dict[str, Path],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    root = first["root"]
    argv = _precompute(first["teacher"], root / "here" / "data" / "texts.txt", root / "here" / "cache")
    argv[argv.index("1,2")] = "1"
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "spec hidden_layers differs: the cache has [1, 2], this writer has [1]" in err
    assert "setting layers" not in err  # the same change in the fingerprint's words


def test_a_path_is_a_label_only_where_content_hashes_speak() -> None:
    cached = {"data": {"source": "/a/texts.txt", "input_ids_hash": "sha256:1", "num_sequences": 4},
              "teacher": {"name_or_path": "/a/teacher", "weights_hash": "sha256:w", "config_hash": "sha256:c"}}
    moved = {"data": {**cached["data"], "source": "/b/texts.txt"},
             "teacher": {**cached["teacher"], "name_or_path": "/b/teacher"}}
    assert compare_fingerprints(cached, moved, strict=True) == []
    # A cache written before the rows were hashed has only its path to go by.
    old = {"data": {"source": "/a/texts.txt", "num_sequences": 4}}
    assert compare_fingerprints(old, {"data": {"source": "/b/texts.txt", "num_sequences": 4}}) == [
        "data source differs: the cache has '/a/texts.txt', expected '/b/texts.txt'"]
    # An unrecorded hash (None) speaks for nothing.
    none = {"teacher": {"name_or_path": "/a/t", "weights_hash": None}}
    assert compare_fingerprints(none, {"teacher": {"name_or_path": "/b/t", "weights_hash": None}})
