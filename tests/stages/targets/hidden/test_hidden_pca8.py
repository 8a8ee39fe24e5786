"""``--hidden-codec pca8 --hidden-rank d``: int8 codes of full-rank PCA coefficients at a step of ``step`` x each
row's RMS, the torch encode against the numpy reference, a stage-one cache whose recorded error matches a
recomputation and whose codes zarr stores column-major, training and evaluation from it, and bad settings."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.stages.targets.hidden.device_codecs import Projection, decode_batch, encode
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.evaluation.evaluate import evaluate_run
from kdcache.stages.train.loop import run_training
from kdcache.storage import CacheReader
from kdcache.storage.hidden_codecs import decode, hidden_codec_of
from kdcache.storage.verify import verify_cache
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.targets.hidden.test_hidden_codecs import _host, _teacher_hidden
from tests.stages.targets.hidden.test_hidden_projection import _plain_bases
from tests.stages.train._train_support import make_student_config, precompute_cache

PCA8 = ("--features", "hidden,logits", "--logits", "head", "--layers", "0,1,2", "--hidden-codec", "pca8",
        "--hidden-rank", "32")


@pytest.fixture(scope="module")
def pca8_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pca8")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    return {"root": root, "teacher": teacher, "cache": precompute_cache(teacher, root / "cache", num_sequences=16,
                                                                        extra=PCA8)}


def test_torch_encode_steps_by_the_row_rms_and_decodes_like_the_numpy_reference() -> None:
    record = hidden_codec_of({"name": "pca8", "configuration": {"rank": 64, "step": 0.3}}, "fp16")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 9, 64)) * np.geomspace(10, 0.01, 64)).astype(np.float32)  # decaying variances
    mean = x.reshape(-1, 64).mean(0)
    bases = {"hidden/2": (np.linalg.svd(x.reshape(-1, 64) - mean)[2].astype(np.float32), mean)}
    host = _host(encode(record, "hidden/2", torch.from_numpy(x), Projection.from_arrays(bases)))
    coef = (x.reshape(-1, 64) - mean) @ bases["hidden/2"][0].T
    want_scale = (0.3 * np.sqrt((coef ** 2).mean(1, keepdims=True))).astype(np.float16)
    np.testing.assert_allclose(host["hidden_scale/2"].astype(np.float32), want_scale.astype(np.float32), rtol=1e-3)
    assert host["hidden/2"].dtype == np.int8 and set(host) == {"hidden/2", "hidden_scale/2", "hidden_error/2"}
    reference = decode(record, host, "hidden/2", bases)
    batch = {k: torch.from_numpy(v.reshape(2, 9, -1)) for k, v in host.items() if "error" not in k}
    on_device = decode_batch(record, batch, Projection.from_arrays(bases))["hidden/2"]
    np.testing.assert_allclose(on_device.reshape(-1, 64).numpy(), reference, rtol=1e-5, atol=1e-4)
    flat = x.reshape(-1, 64)
    rel = np.sqrt(((reference - flat) ** 2).sum() / (flat ** 2).sum())
    codes = host["hidden/2"]  # the leading directions take the codes, the tail rounds to zero (what zstd shrinks)
    assert 0.01 < rel < 0.1 and np.abs(codes[:, 0]).max() > 10 and not codes[:, -16:].any()


@pytest.mark.slow
def test_a_pca8_cache_records_its_error_stores_codes_column_major_and_verifies(pca8_cache: dict[str, Path]) -> None:
    cache = pca8_cache["cache"]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["spec"]["hidden_codec"] == {"name": "pca8", "configuration": {
        "rotation": None, "outliers": 0, "group": 64, "step": 0.24, "rank": 32}}
    bases = _plain_bases(cache)
    assert all(b.shape == (32, 32) for b, _ in bases.values())  # every direction: R = d
    meta = json.loads((cache / "shards" / "shard-000000" / "hidden" / "2" / "zarr.json").read_text())
    inner = meta["codecs"][0]["configuration"]["codecs"]
    assert [c["name"] for c in inner] == ["bytes", "numcodecs.shuffle", "blosc", "crc32c"]
    reader = CacheReader(cache)
    ids = [reader.get(i)["input_ids"] for i in range(8)]
    want = np.concatenate([o[2] for o in _teacher_hidden(pca8_cache["teacher"], ids)])
    got = np.concatenate([decode(reader.spec.hidden_codec, reader.get(i), "hidden/2", bases) for i in range(8)])
    rel = np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum())
    assert reader.records[0].lossy["hidden/2"]["rel_rms_error"] == pytest.approx(rel, rel=2e-2)
    assert 0.005 < rel < 0.08
    assert verify_cache(cache).ok


@pytest.mark.slow
def test_a_pca8_cache_trains_and_evaluates(pca8_cache: dict[str, Path]) -> None:
    root = pca8_cache["root"]
    student = make_student_config(root / "student", pca8_cache["teacher"], n_layer=1, n_embd=16, n_head=2)
    for loss in ("mse", "cka"):
        out = root / f"run-{loss}"
        summary = run_training(TrainOptions.of(cache=str(pca8_cache["cache"]), student=str(student), out=str(out),
                                               batch_size=4, lr=3e-3, max_steps=2, hidden_loss=loss,
                                               layer_map="last"))
        assert summary["last_loss"] is not None and np.isfinite(summary["last_loss"])
    result = evaluate_run(out, CacheReader(pca8_cache["cache"]), batch_size=4)
    assert np.isfinite(result["kl"]) and np.isfinite(result["cka"]["final"])


@pytest.mark.parametrize(("extra", "message"), [
    (("--hidden-codec", "pca8"), "--hidden-codec pca8 codes full-rank PCA coefficients: give --hidden-rank d"),
    (("--hidden-codec", "pca8", "--hidden-rank", "16"), "R = 16, but codec 'pca8' codes full-rank PCA coefficients: "
                                                        "expected R = d = 32"),
    (("--hidden-codec", '{"name": "pca8", "configuration": {"step": 0}}', "--hidden-rank", "32"),
     "step must be a number in (0, 8]"),
    (("--hidden-codec", '{"name": "pca8", "configuration": {"outliers": 4}}', "--hidden-rank", "32"),
     "takes no rotation and no outliers"),
])
def test_a_bad_pca8_setting_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              extra: tuple[str, ...], message: str) -> None:
    from kdcache.pipeline.cli import main

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=1, hidden=32, heads=4)
    (tmp_path / "d.txt").write_text("one text\nanother text\n")
    code = main(["precompute", "--teacher", str(teacher), "--data", str(tmp_path / "d.txt"), "--out",
                 str(tmp_path / "c"), "--no-progress", *extra])
    out = capsys.readouterr()
    assert code == 2 and message in out.out + out.err and "Traceback" not in out.err
    assert not (tmp_path / "c" / "manifest.json").exists()
