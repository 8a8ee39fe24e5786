"""A new hidden codec is one module: this one defines ``test_int6`` (6-bit codes, -31..31, in int8 bytes, one
scale per row), registers it, and runs it through stage one (``kdcache precompute`` on its device path), ``verify``,
``inspect`` and stage two (training and eval), with nothing else changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kdcache.storage import CacheReader
from kdcache.storage.hidden_codecs import HIDDEN_CODECS, QuantisedCodec, decode, namespace, register
from kdcache.storage.hidden_codecs.arrays import Array
from kdcache.storage.verify import verify_cache
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, precompute_cache


class Int6(QuantisedCodec):
    """6-bit codes in int8 bytes: the shared outliers, rotation and scale, and codes of its own."""

    name = "test_int6"
    help = "6-bit codes in int8 bytes (a test's own codec)"
    order = 99
    code_dtype = "int8"
    qmax = 31.0

    def to_codes(self, scaled: Array) -> Array:
        xp = namespace(scaled)
        return xp.astype(xp.round(scaled), xp.int8)

    def from_codes(self, codes: Array) -> Array:
        xp = namespace(codes)
        return xp.astype(codes, xp.float32)


@pytest.fixture
def int6() -> Iterator[type[Int6]]:
    """The codec registered for one test only."""
    register(Int6)
    yield Int6
    del HIDDEN_CODECS[Int6.name]


def test_the_registry_lists_the_new_codec_and_the_flag_offers_it(int6: type[Int6]) -> None:
    from kdcache.storage.hidden_codecs import names, usage

    assert names()[-1] == "test_int6" and "test_int6: 6-bit codes" in usage()


@pytest.mark.slow
def test_a_codec_defined_in_a_test_module_runs_end_to_end(int6: type[Int6], tmp_path: Path) -> None:
    from kdcache.stages.train.core.options import TrainOptions
    from kdcache.stages.train.evaluation.evaluate import evaluate_run
    from kdcache.stages.train.loop import run_training
    from tests.stages.targets.hidden.test_hidden_codecs import _teacher_hidden
    from tests.storage._cache_data import run_cli

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=2, hidden=32, heads=4)
    cache = precompute_cache(teacher, tmp_path / "cache", num_sequences=16, extra=(
        "--features", "hidden,logits", "--top-k", "8", "--hidden-codec", "test_int6", "--device", "cpu"))
    reader = CacheReader(cache)
    assert reader.spec.hidden_codec.record() == {"name": "test_int6",
                                                 "configuration": {"rotation": 0, "outliers": 4, "group": 64}}
    item = reader.get(0)
    assert item["hidden/1"].dtype == np.int8 and np.abs(item["hidden/1"]).max() <= 31  # its own codes
    want = _teacher_hidden(teacher, [item["input_ids"]])[0][1]
    got = decode(reader.spec.hidden_codec, item, "hidden/1")
    rel = np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum())
    assert 0.002 < rel < 0.05  # 6 bits: coarser than int7 (~1%), far finer than a broken decode
    assert reader.records[0].lossy["hidden/1"]["codec"] == "test_int6"
    assert verify_cache(cache).ok
    code, text = run_cli("inspect", str(cache))
    assert code == 0 and "hidden codec test_int6 (rotation seed 0, outliers 4)" in text
    student = make_student_config(tmp_path / "student", teacher, n_layer=1, n_embd=16, n_head=2)
    out = tmp_path / "run"
    summary = run_training(TrainOptions.of(cache=str(cache), student=str(student), out=str(out), batch_size=4,
                                           lr=3e-3, max_steps=2, hidden_loss="mse", layer_map="last"))
    assert summary["last_loss"] is not None and np.isfinite(summary["last_loss"])
    assert np.isfinite(evaluate_run(out, CacheReader(cache), batch_size=4)["kl"])


def test_writer_processes_say_when_a_codec_of_a_test_s_own_is_not_theirs(int6: type[Int6], tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """This module registers its codec in a fixture, not on import, so a writer process (which imports the codec's
    module anew) cannot find it: the run stops with a message saying so, not a hang or a traceback."""
    from kdcache.pipeline.cli import main
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=2, hidden=32, heads=4)
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(6))
    code = main(["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(tmp_path / "cache"),
                 "--features", "hidden", "--hidden-codec", "test_int6", "--writer-processes", "--writers", "1",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "a writer process could not start" in err and "unknown hidden codec 'test_int6'" in err
    assert "must register itself when its module is imported" in err and "Traceback" not in err
