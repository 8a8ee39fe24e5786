"""Stage one records the teacher's depth, so formula layer maps stay right when the top block isn't cached."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.train.core.plan import teacher_depth
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def test_depth_is_recorded_even_without_the_top_layer(tiny_gpt2: Path, tmp_path: Path) -> None:
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(6))
    out = tmp_path / "cache"
    run_precompute(PrecomputeOptions.of(teacher=str(tiny_gpt2), data=str(data), out=str(out), layers=("1", "2"),
                                     features=("hidden",), max_length=16, progress=False))
    reader = CacheReader(out)
    assert max(reader.spec.hidden_layers) == 2
    assert teacher_depth(reader) == 3  # the tiny GPT-2 has 3 blocks; guessing from the cache would say 2


def test_maps_on_a_cache_without_the_top_layer_name_it(tiny_gpt2: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The default map (uniform) keeps its pairs the cache holds and names the top layer it lacks; a map given by
    name (last) is refused naming it. Both need the recorded depth (3): from the cache alone it would be 2."""
    from kdcache.pipeline.cli import main

    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(6))
    cache = tmp_path / "cache"
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache),
                 "--layers", "1,2", "--features", "hidden", "--max-length", "16", "--no-progress"]) == 0
    capsys.readouterr()
    train = ["train", "--cache", str(cache), "--student", str(tiny_gpt2), "--max-steps", "1", "--beta", "0", "--batch-size", "2"]
    code = main([*train, "--out", str(tmp_path / "last"), "--layer-map", "last"])
    err = capsys.readouterr().err
    assert code == 2 and "teacher hidden layers 3" in err and "Traceback" not in err
    assert main([*train, "--out", str(tmp_path / "run"), "--json"]) == 0
    err = capsys.readouterr().err
    assert "uniform hidden map keeps the pairs whose teacher layer the cache holds: s1_t1, s2_t2 (of 3; " \
           "precompute with --layers 1,2,3" in err
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["hidden_pairs"] == [[1, 1], [2, 2]]
