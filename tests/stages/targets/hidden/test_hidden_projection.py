"""``--hidden-rank R``: the projection basis fitted by stage one, stored once in the cache and read with plain
numpy, errors measured against the unprojected states, training and evaluation from a rank cache, a second job
of the array reusing the stored basis, and the rank's validation."""

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
from kdcache.storage.hidden_codecs import decode, hidden_codec_of, resolve_hidden_codec
from kdcache.storage.verify import verify_cache
from tests.helpers.tiny_models import make_tiny_gpt2
from tests.stages.targets.hidden.test_hidden_codecs import _host, _teacher_hidden
from tests.stages.train._train_support import make_student_config, precompute_cache

RANK = 8
RANK_CODEC = ("--features", "hidden,logits", "--logits", "head", "--layers", "0,1,2", "--hidden-codec", "int8",
              "--hidden-rank", str(RANK))


def _plain_bases(cache: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every layer's (basis, mean) read with numpy alone."""
    return {f"hidden/{j}": (np.load(cache / "projection" / f"hidden.{j}.basis.npy"),
                            np.load(cache / "projection" / f"hidden.{j}.mean.npy")) for j in (0, 1, 2)}


@pytest.fixture(scope="module")
def rank_cache(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank")
    teacher = make_tiny_gpt2(root / "teacher", layers=2, hidden=32, heads=4)
    return {"root": root, "teacher": teacher, "cache": precompute_cache(teacher, root / "cache", num_sequences=16,
                                                                        extra=RANK_CODEC)}


def test_torch_encode_with_a_basis_decodes_like_the_numpy_reference() -> None:
    record = hidden_codec_of({"name": "int8", "configuration": {"rank": 16}}, "fp16")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 9, 16)) @ rng.standard_normal((16, 64))).astype(np.float32)  # rank 16 in d = 64
    mean = x.reshape(-1, 64).mean(0)
    basis = np.linalg.svd(x.reshape(-1, 64) - mean)[2][:16].astype(np.float32)
    bases = {"hidden/2": (basis, mean)}
    parts = encode(record, "hidden/2", torch.from_numpy(x), Projection.from_arrays(bases))
    host = _host(parts)
    assert host["hidden/2"].shape == (18, 16)  # [T, R] coefficients
    reference = decode(record, host, "hidden/2", bases)
    batch = {k: v for k, v in parts.items() if "error" not in k}
    on_device = decode_batch(record, batch, Projection.from_arrays(bases))["hidden/2"]
    np.testing.assert_allclose(on_device.reshape(-1, 64).numpy(), reference, rtol=1e-5, atol=1e-4)
    flat = x.reshape(-1, 64)  # errors against the unprojected rows
    assert host["hidden_error/2"][:, 0].sum() == pytest.approx(((reference - flat) ** 2).sum(), rel=1e-3)
    assert np.sqrt(((reference - flat) ** 2).sum() / (flat ** 2).sum()) < 0.02


def test_a_record_without_a_rank_is_the_record_of_before() -> None:
    assert resolve_hidden_codec({"name": "int8", "configuration": {"rank": None}}, "fp16") == \
        resolve_hidden_codec("int8", "fp16")
    assert "rank" not in resolve_hidden_codec("int4", "fp16")["configuration"]


def test_a_cache_without_a_rank_has_no_projection_and_decodes_as_before(tmp_path: Path) -> None:
    from kdcache.stages.targets.hidden.device_codecs import load_projection
    from kdcache.storage import CacheSpec, CacheWriter

    spec = CacheSpec(num_sequences=2, hidden_layers=(1,), hidden_codec="int8", sequences_per_shard=2)
    rng = np.random.default_rng(0)
    seqs = [{"input_ids": np.arange(5), "hidden/1": rng.standard_normal((5, 16)).astype(np.float32)} for _ in "ab"]
    with CacheWriter(tmp_path, spec, {}) as writer:
        writer.write_shard(0, seqs)
        writer.finalize()
    reader = CacheReader(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert "rank" not in manifest["spec"]["hidden_codec"]["configuration"] and not (tmp_path / "projection").exists()
    assert not any(k.startswith("projection/") for k in manifest.get("files", {}))
    assert load_projection(reader) is None
    got = decode(reader.spec.hidden_codec, reader.get(1), "hidden/1")  # no basis needed
    np.testing.assert_allclose(got, seqs[1]["hidden/1"], atol=0.05)


@pytest.mark.slow
def test_the_basis_is_stored_plainly_and_the_recorded_error_matches_a_recomputation(
        rank_cache: dict[str, Path]) -> None:
    cache = rank_cache["cache"]
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["spec"]["hidden_codec"]["configuration"]["rank"] == RANK
    assert manifest["fingerprints"]["settings"]["hidden_codec"]["configuration"]["rank"] == RANK
    assert {f"projection/hidden.{j}.{p}.npy" for j in (0, 1, 2) for p in ("basis", "mean")} <= set(manifest["files"])
    bases = _plain_bases(cache)
    for basis, mean in bases.values():
        assert basis.dtype == np.float32 and basis.shape == (RANK, 32) and mean.shape == (32,)
        np.testing.assert_allclose(basis @ basis.T, np.eye(RANK), atol=1e-5)  # orthonormal directions
    reader = CacheReader(cache)
    assert reader.get(0)["hidden/2"].shape[1] == RANK
    ids = [reader.get(i)["input_ids"] for i in range(8)]
    want = np.concatenate([o[2] for o in _teacher_hidden(rank_cache["teacher"], ids)])
    got = np.concatenate([decode(reader.spec.hidden_codec, reader.get(i), "hidden/2", bases) for i in range(8)])
    record = reader.records[0].lossy["hidden/2"]  # measured against the unprojected states: the projection shows
    assert record["rel_rms_error"] == pytest.approx(np.sqrt(((got - want) ** 2).sum() / (want ** 2).sum()), rel=2e-2)
    assert record["rel_rms_error"] > 0.05  # 8 of 32 directions of random-weight states lose a visible share
    assert verify_cache(cache).ok


@pytest.mark.slow
def test_a_rank_cache_trains_every_hidden_loss_with_the_head_and_evaluates(rank_cache: dict[str, Path]) -> None:
    root = rank_cache["root"]
    student = make_student_config(root / "student", rank_cache["teacher"], n_layer=1, n_embd=16, n_head=2)
    for loss in ("mse", "cosine", "cka", "cka_sqrt"):
        out = root / f"run-{loss}"
        summary = run_training(TrainOptions.of(cache=str(rank_cache["cache"]), student=str(student), out=str(out),
                                               batch_size=4, lr=3e-3, max_steps=2, hidden_loss=loss,
                                               layer_map="last"))
        assert summary["last_loss"] is not None and np.isfinite(summary["last_loss"])
    result = evaluate_run(out, CacheReader(rank_cache["cache"]), batch_size=4)
    assert np.isfinite(result["kl"]) and np.isfinite(result["cka"]["final"])


@pytest.mark.slow
def test_a_second_job_of_the_array_reuses_the_stored_basis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kdcache.stages.precompute import runner

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=2, hidden=32, heads=4)
    parts = ("--num-shards", "2", "--shard-index")
    precompute_cache(teacher, tmp_path / "cache", num_sequences=16, extra=(*RANK_CODEC, *parts, "0"))
    stored = {p.name: p.read_bytes() for p in (tmp_path / "cache" / "projection").iterdir()}

    def refit(*args: object, **kwargs: object) -> None:
        raise AssertionError("the basis was fitted again although the cache holds one")

    monkeypatch.setattr(runner, "fit_bases", refit)
    precompute_cache(teacher, tmp_path / "cache", num_sequences=16, extra=(*RANK_CODEC, *parts, "1"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "cache" / "projection").iterdir()} == stored
    reader = CacheReader(tmp_path / "cache")
    assert reader.manifest.status == "complete" and verify_cache(tmp_path / "cache").ok


@pytest.mark.parametrize(("extra", "message"), [
    (("--hidden-codec", "int8", "--hidden-rank", "32"), "R = 32 must be in 1..31: the teacher's hidden size is d = 32"),
    (("--hidden-codec", "int8", "--hidden-rank", "0"), "rank must be an integer >= 1"),
    (("--hidden-rank", "4"), "--hidden-rank 4 codes the projection's coefficients with a quantised --hidden-codec"),
])
def test_a_bad_rank_exits_2_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...],
                                      message: str) -> None:
    from kdcache.pipeline.cli import main

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=1, hidden=32, heads=4)
    (tmp_path / "d.txt").write_text("one text\nanother text\n")
    code = main(["precompute", "--teacher", str(teacher), "--data", str(tmp_path / "d.txt"), "--out",
                 str(tmp_path / "c"), "--no-progress", *extra])
    out = capsys.readouterr()
    assert code == 2 and message in out.out + out.err and "Traceback" not in out.err


@pytest.mark.slow
def test_two_torchrun_ranks_store_one_basis_and_equal_one_process(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.stages.precompute.test_precompute_resume import REPO, _env, assert_same_cache

    teacher = make_tiny_gpt2(tmp_path / "teacher", layers=2, hidden=32, heads=4)
    one = precompute_cache(teacher, tmp_path / "one", num_sequences=16, extra=RANK_CODEC)
    data = tmp_path / "one-texts.txt"  # the same texts
    argv = ["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(tmp_path / "ranks"),
            "--max-length", "24", "--sequences-per-shard", "8", "--batch-size", "16", "--no-progress", *RANK_CODEC]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "kdcache",
           *argv]
    done = subprocess.run(cmd, cwd=REPO, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _plain_bases(tmp_path / "ranks").keys() == _plain_bases(one).keys()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ranks" / "projection").iterdir()} == \
        {p.name: p.read_bytes() for p in (one / "projection").iterdir()}
    assert_same_cache(one, tmp_path / "ranks")
