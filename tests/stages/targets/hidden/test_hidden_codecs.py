"""Hidden-state codecs end to end: the torch encode (stage one's device) against the numpy reference, outliers,
fp8's NaN-free clamp, and caches of every codec written by ``kdcache precompute`` that train and evaluate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.stages.targets.hidden.device_codecs import decode_batch, encode
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.evaluation.evaluate import evaluate_run
from kdcache.stages.train.loop import run_training
from kdcache.storage import CacheReader
from kdcache.storage.hidden_codecs import decode, hidden_codec_of
from kdcache.storage.verify import verify_cache
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.train._train_support import make_student_config, precompute_cache

QUANTISED = ("fp8", "int8", "int4")


def _host(parts: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Device parts as the host gets them (int16 outlier ids read as uint16), rows flattened."""
    out = {}
    for name, value in parts.items():
        array = value.numpy().view(np.uint16) if value.dtype == torch.int16 else value.numpy()
        out[name] = array.reshape(-1, array.shape[-1])
    return out


def _activations(outlier_scale: float = 1.0, seed: int = 0) -> np.ndarray:
    """``[2, 9, 256]`` activations; channels 7 and 100 scaled by ``outlier_scale`` (massive activations)."""
    x = np.random.default_rng(seed).standard_normal((2, 9, 256)).astype(np.float32)
    x[..., 7] *= outlier_scale
    x[..., 100] *= -outlier_scale
    return x


@pytest.mark.parametrize("name", QUANTISED)
def test_torch_encode_decodes_like_the_numpy_reference(name: str) -> None:
    record = hidden_codec_of(name, "fp16")
    x = _activations(300.0)
    parts = encode(record, "hidden/2", torch.from_numpy(x))
    host = _host(parts)
    reference = decode(record, host, "hidden/2")
    on_device = decode_batch(record, {k: v for k, v in parts.items() if "error" not in k})["hidden/2"]
    np.testing.assert_allclose(on_device.reshape(-1, 256).numpy(), reference, rtol=1e-6, atol=1e-5)
    errors = host["hidden_error/2"]  # the per-row errors measured on the device match a recomputation
    flat = x.reshape(-1, 256)
    assert errors[:, 0].sum() == pytest.approx(((reference - flat) ** 2).sum(), rel=1e-4)
    # The largest |error| cancels (decoded - x): where the two decodes differ (each library's matmul order),
    # it moves by up to their largest difference, plus the rounding of the subtraction, not by a relative 1e-5.
    gap, want = float(np.abs(on_device.reshape(-1, 256).numpy() - reference).max()), np.abs(reference - flat).max()
    assert abs(errors[:, 3].max() - want) <= gap + 2 * np.spacing(want)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_small_channels_survive_outliers_only_with_the_outlier_handling(name: str) -> None:
    x = _activations(1000.0)
    small = np.setdiff1d(np.arange(256), [7, 100])

    def small_channel_error(configuration: dict) -> float:
        record = hidden_codec_of({"name": name, "configuration": configuration}, "fp16")
        host = _host(encode(record, "hidden/1", torch.from_numpy(x)))
        got, want = decode(record, host, "hidden/1")[:, small], x.reshape(-1, 256)[:, small]
        return float(np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()))

    handled = small_channel_error({})
    rotation_only = small_channel_error({"outliers": 0})
    unhandled = small_channel_error({"rotation": None, "outliers": 0})
    assert handled < (0.02 if name == "int8" else 0.15)
    assert unhandled > 0.5  # one scale per row set by the outliers flattens the small channels
    if name == "int8":  # one scale per row: the rotation alone already spreads the outliers (int4's groups
        assert rotation_only < unhandled / 2  # spare the channels away from them, so there it needs the outliers)


def test_fp8_never_makes_nan_or_inf() -> None:
    record = hidden_codec_of({"name": "fp8", "configuration": {"rotation": None, "outliers": 0}}, "fp16")
    x = np.array([[60000.0, -60000.0, 448.0, 1e-8, 0.0, 5e4, -3.3, 449.0]] * 3, dtype=np.float32)
    x[1] = 0.0  # an all-zero row: scale 0
    x[2, :2] = [1e-20, -1e-20]
    host = _host(encode(record, "hidden/0", torch.from_numpy(x)))
    assert not np.isin(host["hidden/0"] & 0x7F, [0x7F]).any()  # 0x7F / 0xFF are e4m3fn's NaN
    decoded = decode(record, host, "hidden/0")
    assert np.isfinite(decoded).all() and np.isfinite(host["hidden_scale/0"]).all()
    np.testing.assert_allclose(decoded[0], x[0], rtol=0.07, atol=1e-3)
    assert (decoded[1] == 0).all()


# ---- caches written by stage one, trained and evaluated ------------------------------------------------
@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("codecs")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    out: dict[str, Path] = {"root": root, "teacher": teacher}
    for codec in ("fp16", "bf16", *QUANTISED):
        out[codec] = precompute_cache(teacher, root / codec, num_sequences=16, extra=(
            "--features", "hidden,logits", "--logits", "head", "--layers", "0,1,2", "--hidden-codec", codec,
            "--format", "arrow" if codec == "int8" else "zarr"))
    out["student"] = make_student_config(root / "student", teacher, n_layer=1, n_embd=16, n_head=2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("codec", ("bf16", *QUANTISED))
def test_stage_one_records_the_codec_and_errors_that_match_a_recomputation(codec: str,
                                                                           caches: dict[str, Path]) -> None:
    reader = CacheReader(caches[codec])
    manifest = json.loads((caches[codec] / "manifest.json").read_text())
    assert manifest["spec"]["hidden_codec"]["name"] == codec
    assert manifest["fingerprints"]["settings"]["hidden_codec"]["name"] == codec
    assert verify_cache(caches[codec]).ok
    if codec == "bf16":
        return
    ids = [reader.get(i)["input_ids"] for i in range(8)]
    outputs = _teacher_hidden(caches["teacher"], ids)
    record = reader.records[0].lossy["hidden/2"]
    decoded = [decode(reader.spec.hidden_codec, reader.get(i), "hidden/2") for i in range(8)]
    want = np.concatenate([o[2] for o in outputs])
    got = np.concatenate(decoded)
    assert record["rel_rms_error"] == pytest.approx(np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()), rel=2e-2)
    assert record["worst_row_cosine"] > 0.9 and record["max_abs_error"] == pytest.approx(
        np.abs(got - want).max(), rel=5e-2)


def _teacher_hidden(teacher: Path, ids: list[np.ndarray]) -> list[np.ndarray]:
    """The teacher's fp32 hidden states ``[N+1, L, d]`` of each id sequence, one at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(teacher)).eval()
    with torch.no_grad():
        return [torch.stack(model(torch.as_tensor(i[None].astype(np.int64)), output_hidden_states=True)
                            .hidden_states)[:, 0].numpy() for i in ids]


@pytest.mark.slow
@pytest.mark.parametrize("codec", ("fp16", "bf16", *QUANTISED))
def test_every_codec_trains_every_hidden_loss_and_evaluates(codec: str, caches: dict[str, Path]) -> None:
    for loss in ("mse", "cosine", "cka", "cka_sqrt"):
        out = caches["root"] / f"run-{codec}-{loss}"
        summary = run_training(TrainOptions.of(cache=str(caches[codec]), student=str(caches["student"]),
                                               out=str(out), batch_size=4, lr=3e-3, max_steps=2, hidden_loss=loss,
                                               layer_map="last"))
        assert summary["last_loss"] is not None and np.isfinite(summary["last_loss"])
    result = evaluate_run(out, CacheReader(caches[codec]), batch_size=4)
    assert np.isfinite(result["kl"]) and np.isfinite(result["cka"]["final"])


@pytest.mark.slow
def test_topk_shards_record_the_probability_mass_their_k_keep(caches: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    cache = precompute_cache(caches["teacher"], caches["root"] / "topk", num_sequences=16,
                             extra=("--features", "logits", "--logits", "topk", "--top-k", "4"))
    reader = CacheReader(cache)
    model = AutoModelForCausalLM.from_pretrained(str(caches["teacher"])).eval()
    for record in reader.records:
        masses = []
        for i in range(record.seq_start, record.seq_stop):
            ids = torch.as_tensor(reader.get(i)["input_ids"][None].astype(np.int64))
            with torch.no_grad():
                probs = model(ids).logits[0].float().softmax(-1)
            masses.append(probs.topk(4, dim=-1).values.sum(-1).numpy())
        mass = np.concatenate(masses)
        got = record.lossy["logits/topk_values"]
        assert got["kept_mass_mean"] == pytest.approx(mass.mean(), rel=1e-4)
        assert got["kept_mass_p5"] == pytest.approx(np.percentile(mass, 5), rel=1e-4)
        assert got["kept_mass_min"] == pytest.approx(mass.min(), rel=1e-4)
    assert 0 < reader.manifest.arrays["logits/topk_values"]["lossy"]["kept_mass_min"] < 1


@pytest.mark.slow
def test_encoder_decoder_teachers_quantise_both_streams(tmp_path: Path) -> None:
    from kdcache.pipeline.cli import main
    from tests.helpers.tiny_models import make_tiny_bart, sample_pairs, write_pair_dataset
    from tests.stages.precompute.test_seq2seq_precompute import online

    teacher = make_tiny_bart(tmp_path / "bart")
    pairs = write_pair_dataset(tmp_path / "pairs.jsonl", sample_pairs(6))
    assert main(["precompute", "--teacher", str(teacher), "--data", str(pairs), "--out", str(tmp_path / "cache"),
                 "--source-column", "source", "--target-column", "target", "--max-length", "32", "--features",
                 "hidden", "--hidden-codec", "int8", "--sequences-per-shard", "3", "--no-progress"]) == 0
    reader = CacheReader(tmp_path / "cache")
    coded = [n for n in reader.spec.sequence_names() if reader.spec.coded(n)]
    assert {n.split("/")[0] for n in coded} == {"encoder", "decoder"}
    for i in (0, 5):
        item = reader[i]
        ref = online(teacher, item["encoder/input_ids"].tolist(), item["decoder/input_ids"].tolist())
        for name in coded:
            got, want = decode(reader.spec.hidden_codec, item, name), ref[name]
            assert np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()) < 0.02, (i, name)
    assert verify_cache(tmp_path / "cache").ok


def test_an_unknown_codec_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kdcache.pipeline.cli import main

    code = main(["precompute", "--teacher", str(tmp_path), "--data", str(tmp_path / "d.txt"), "--out",
                 str(tmp_path / "c"), "--hidden-codec", "int3"])
    out = capsys.readouterr()
    assert code == 2 and "unknown hidden codec 'int3'" in out.out + out.err and "Traceback" not in out.err
