"""Each command validates its options once and opens its cache once; one EngineOptions serves both stages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

import kdcache.storage.core.stores as stores
from kdcache.pipeline.cli import build_parser, main
from kdcache.pipeline.config import ConfigError, build
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.train.core.options import TrainOptions
from tests.helpers.tiny_models import sample_texts, write_text_dataset


class _Counted(stores.LocalStore):
    """The real local store, counting how often each folder is opened."""

    opened: list[str] = []

    def __init__(self, root: Any) -> None:
        super().__init__(root)
        _Counted.opened.append(str(Path(root).resolve()))


@pytest.fixture()
def counted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every LocalStore ``open_store`` makes from here on, by resolved folder."""
    monkeypatch.setattr(stores, "LocalStore", _Counted)
    monkeypatch.setattr(_Counted, "opened", [])
    return _Counted.opened


def _counting_validate(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    calls: list[int] = []
    real = cls.validate

    def validate(self: Any) -> list[str]:
        calls.append(1)
        return real(self)

    monkeypatch.setattr(cls, "validate", validate)
    return calls


def test_precompute_validates_once_and_opens_its_out_store_once(tiny_gpt2: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                counted: list[str]) -> None:
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(6))
    calls = _counting_validate(monkeypatch, PrecomputeOptions)
    out = tmp_path / "cache"
    argv = ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(out), "--layers", "1,3",
            "--features", "hidden,logits", "--logits", "head", "--sequences-per-shard", "4", "--no-progress"]
    assert main(argv) == 0
    assert len(calls) == 1
    # tokenizer, teacher head, two shards and the manifest all went through the one store
    assert counted.count(str(out.resolve())) == 1, counted
    assert (out / "tokenizer").is_dir() and (out / "teacher_head" / "head.json").is_file()
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


def test_train_validates_once_and_reads_through_one_reader(tiny_gpt2: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           counted: list[str]) -> None:
    from tests.stages.train._train_support import write_cache

    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=8)
    counted.clear()
    calls = _counting_validate(monkeypatch, TrainOptions)
    run = tmp_path / "run"
    assert main(["train", "--cache", str(cache), "--student", str(tiny_gpt2), "--out", str(run), "--max-steps", "2",
                 "--batch-size", "2", "--alpha", "0", "--beta", "0", "--quiet"]) == 0
    assert len(calls) == 1
    assert counted.count(str(cache.resolve())) == 1, counted  # checks, stream and the tokenizer's copy: one open
    assert (run / "student" / "tokenizer.json").is_file()


def test_every_problem_still_shows_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        build(PrecomputeOptions, {"data": str(tmp_path / "none.jsonl"), "out": str(tmp_path / "c"),
                                  "batch_size": "many", "queue_size": 0})
    problems = err.value.problems
    assert "teacher is required (flag --teacher)" in problems
    assert any("batch_size: got 'many'" in p for p in problems) and any("queue_size" in p for p in problems)
    assert any("data: no file or folder matches" in p for p in problems), problems


def test_one_engine_options_class_each_stage_its_own_fields(tmp_path: Path) -> None:
    pre = {f.name: f for f in dataclasses.fields(PrecomputeOptions)}["engine"].type
    train = {f.name: f for f in dataclasses.fields(TrainOptions)}["engine"].type
    assert pre == train == "EngineOptions"
    from kdcache.stages.precompute.core.options import EngineOptions as PrecomputeEngine
    from kdcache.stages.train.core.options import EngineOptions as TrainEngine

    assert PrecomputeEngine is TrainEngine
    train_help = build_parser(["train"]).parse_args(["train"]).commands["train"].format_help()
    pre_help = build_parser(["precompute"]).parse_args(["precompute"]).commands["precompute"].format_help()
    assert "--teacher" not in train_help and "--queue-size" not in train_help and "--zero-stage" in train_help
    assert "--zero-stage" not in pre_help and "--lr" not in pre_help and "--teacher TEACHER" in pre_help
    options = TrainOptions.of(cache="c", student="s", out="o", lr=0.5, batch_size=3)
    assert options.engine.lr == 0.5 and options.data.batch_size == 3  # batch_size stays stage two's data option
    assert "teacher" not in options.to_dict() and options.to_dict()["lr"] == 0.5
    with pytest.raises(ConfigError, match="unknown key 'teacher'"):
        build(TrainOptions, {"cache": "c", "student": str(tmp_path), "out": str(tmp_path / "r"), "teacher": "t"})


def test_a_stream_over_the_commands_reader_reads_it_in_process_and_reopens_in_workers(tiny_gpt2: Path,
                                                                                     tmp_path: Path,
                                                                                     counted: list[str]) -> None:
    import torch

    from kdcache.stages.train.core.checks import open_cache
    from kdcache.stages.train.feed.streaming import CacheStream
    from tests.stages.train._train_support import write_cache

    cache = write_cache(tiny_gpt2, tmp_path / "cache", num_sequences=12, hidden_layers=(1,))
    counted.clear()
    reader = open_cache(cache)
    kwargs: dict[str, Any] = dict(batch_size=2, seed=4, epochs=1, shuffle_block=4)
    in_process = [b["sample_ids"].tolist() for b in CacheStream(reader, ["input_ids", "hidden/1"], **kwargs)]
    assert len(counted) == 1  # the stream read through the reader it was given
    by_path = [b["sample_ids"].tolist() for b in CacheStream(cache, ["input_ids", "hidden/1"], **kwargs)]
    loader = torch.utils.data.DataLoader(CacheStream(reader, ["input_ids", "hidden/1"], **kwargs), batch_size=None,
                                         num_workers=2)
    in_workers = sorted(b["sample_ids"].tolist() for b in loader)  # each worker opened its own reader
    assert in_process == by_path and sorted(in_process) == in_workers and len(in_process) == 6
