"""Stage one records the teacher's depth, so formula layer maps stay right when the top block isn't cached."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdcache.stages.precompute import PrecomputeOptions, run_precompute
from kdcache.stages.train.plan import teacher_depth
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


def test_uniform_map_on_a_cache_without_the_top_layer_names_it(tiny_gpt2: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.pipeline.cli import main

    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(6))
    cache = tmp_path / "cache"
    assert main(["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache),
                 "--layers", "1,2", "--features", "hidden", "--max-length", "16", "--no-progress"]) == 0
    code = main(["train", "--cache", str(cache), "--student", str(tiny_gpt2), "--out", str(tmp_path / "run"),
                 "--max-steps", "1", "--beta", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "teacher hidden layers 3" in err and "Traceback" not in err
