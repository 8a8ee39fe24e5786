"""Logit modes of a cache (issue 11): exact teacher logits from the cached last layer and a copy of the LM head.

A tiny random Llama teacher; the reference is the same data cached with full logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.targets.logits.full_torch import kd_kl
from kdcache.stages.targets.logits.head_torch import head_kl
from kdcache.stages.targets.logits.teacher_head import load_teacher_head
from kdcache.stages.train.feed.streaming import collate, to_device
from kdcache.storage import CacheReader
from kdcache.storage.core.errors import KdcacheError
from kdcache.storage.core.stores import open_store
from tests.helpers.tiny_models import make_tiny_llama, sample_texts, write_text_dataset


def _cache(tmp_path: Path, teacher: Path, name: str, **overrides: Any) -> CacheReader:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_text_dataset(data, sample_texts(12, seed=5))
    opts = dict(teacher=str(teacher), data=str(data), out=str(tmp_path / name), max_length=40, batch_size=4,
                layers=("1",), progress=False)
    run_precompute(PrecomputeOptions.of(**{**opts, **overrides}))
    return CacheReader(tmp_path / name)


def _batch(reader: CacheReader) -> dict[str, torch.Tensor]:
    return to_device(collate([reader[i] for i in range(len(reader))], range(len(reader))), "cpu")


def test_head_mode_kl_equals_the_full_logit_cache_kl(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    full = _batch(_cache(tmp_path, tiny_llama, "full", full_logits=True))
    reader = _cache(tmp_path, tiny_llama, "head", logits_mode="head")
    assert reader.spec.logits == "head" and reader.spec.hidden_layers == (1, 3)  # the last layer is always kept
    assert "logits/full" not in reader.spec.sequence_names()
    batch, head = _batch(reader), load_teacher_head(reader.store)
    assert head.layer == 3
    student = AutoModelForCausalLM.from_pretrained(str(make_tiny_llama(tmp_path / "student", seed=4))).eval()
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits
        for temperature in (1.0, 2.0):
            want = kd_kl(logits, full["logits/full"], batch["mask"], temperature)
            got = head_kl(logits, batch["hidden/3"], head, batch["mask"], temperature)
            assert float(got) == pytest.approx(float(want), rel=2e-3), temperature
        rebuilt = head(batch["hidden/3"][batch["mask"].bool()])
    # fp16 storage of the hidden state (vs fp16 logits in the full cache, handed over as stored) is the only
    # difference.
    torch.testing.assert_close(rebuilt, full["logits/full"][batch["mask"].bool()].float(), rtol=0, atol=2e-2)


def test_training_and_eval_on_a_head_cache(tiny_llama: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _cache(tmp_path, tiny_llama, "cache", logits_mode="head", sequences_per_shard=6)
    run = tmp_path / "run"
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out", str(run),
                 "--max-steps", "2", "--batch-size", "4", "--gamma", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "teacher head from the cache: 0.0M parameters" in err and "applied to cached layer 3" in err
    # A loss for another mode is refused, naming both.
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out",
                 str(tmp_path / "other"), "--topk-kl", "other", "--temperature", "1", "--gamma", "0"]) == 2
    assert "--topk-kl other is a KL for caches written with --logits topk, and this cache holds head logits" in \
        capsys.readouterr().err
    assert main(["eval", "--cache", str(tmp_path / "cache"), "--run", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kl_form"] == "full" and 0 <= result["top1_agreement"] <= 1 and result["kl"] >= 0
    # Scored against a full-logit cache of the same data, the same run gets the same KL and top-1.
    _cache(tmp_path, tiny_llama, "full", full_logits=True)
    assert main(["eval", "--cache", str(tmp_path / "full"), "--run", str(run), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert result["kl"] == pytest.approx(full["kl"], rel=1e-2, abs=1e-4)
    assert result["top1_agreement"] == pytest.approx(full["top1_agreement"], abs=0.02)


def test_a_damaged_or_missing_head_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    reader = _cache(tmp_path, tiny_llama, "cache", logits_mode="head")
    weights = tmp_path / "cache" / "teacher_head" / "head.safetensors"
    record = tmp_path / "cache" / "teacher_head" / "head.json"  # not hashed: its layer is checked instead
    good = record.read_text()
    record.write_text(good.replace('"layer": 3', '"layer": 1'))
    with pytest.raises(KdcacheError, match="reads layer 1, but its last cached hidden layer is 3"):
        load_teacher_head(reader.store, reader.spec.hidden_layers)
    record.write_text("[]")
    with pytest.raises(KdcacheError, match="expected a JSON object"):
        load_teacher_head(reader.store)
    record.write_text(good)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(KdcacheError, match="does not match the sha256 recorded in head.json"):
        load_teacher_head(open_store(tmp_path / "cache"))
    weights.unlink()
    with pytest.raises(KdcacheError, match="written with --logits head but its teacher_head/ cannot be read"):
        load_teacher_head(reader.store)


def test_head_mode_needs_a_decoder_only_lm(tiny_bert: Path, tmp_path: Path, capsys) -> None:
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(4))
    assert main(["precompute", "--teacher", str(tiny_bert), "--data", str(data), "--out", str(tmp_path / "c"),
                 "--logits", "head", "--no-progress"]) == 2
    assert "logits head: only for decoder-only causal LMs" in capsys.readouterr().err


def test_logprob_topk_is_within_its_tolerance_and_trains_like_fp16(tiny_llama: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from kdcache.stages.targets.logits.topk_torch import cached_topk, topk_kl

    full = _batch(_cache(tmp_path, tiny_llama, "full", full_logits=True))
    fp16 = _batch(_cache(tmp_path, tiny_llama, "fp16", top_k=16))
    reader = _cache(tmp_path, tiny_llama, "logprob", top_k=16, topk_values="logprob", logprob_tolerance=0.005)
    assert reader.spec.topk_values == "logprob" and reader.spec.logprob_step == pytest.approx(0.00995)
    assert "logits/lse" not in reader.spec.sequence_names()
    for shard in reader.manifest.shards:  # the writer's own measure, against the exact fp32 log-probs
        assert 0 < shard.lossy["logits/topk_values"]["max_abs_error"] <= 0.005
    batch, valid = _batch(reader), full["mask"].bool()
    exact = torch.log_softmax(full["logits/full"].float(), -1)  # fp16 logits: within fp16 rounding of exact
    want = exact.gather(-1, batch["logits/topk_ids"].long())[valid]
    assert (batch["logits/topk_values"][valid] - want).abs().max() <= 0.005 + 0.02
    assert torch.equal(batch["logits/topk_ids"], fp16["logits/topk_ids"])
    student = AutoModelForCausalLM.from_pretrained(str(make_tiny_llama(tmp_path / "student", seed=4))).eval()
    with torch.no_grad():
        logits = student(input_ids=batch["input_ids"], attention_mask=batch["mask"]).logits
        for variant, temperature in (("renorm", 2.0), ("other", 1.0)):
            got = topk_kl(logits, *cached_topk(batch)[:2], batch["mask"], cached_topk(batch)[2], variant=variant,
                          temperature=temperature)
            ref = topk_kl(logits, *cached_topk(fp16)[:2], fp16["mask"], cached_topk(fp16)[2], variant=variant,
                          temperature=temperature)
            assert float(got) == pytest.approx(float(ref), rel=2e-2, abs=1e-3), variant


def test_training_and_eval_on_a_logprob_cache(tiny_llama: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _cache(tmp_path, tiny_llama, "cache", top_k=16, topk_values="logprob", sequences_per_shard=6)
    run = tmp_path / "run"
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out", str(run),
                 "--max-steps", "2", "--batch-size", "4", "--gamma", "0", "--topk-kl", "other", "--temperature", "1",
                 "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", "--cache", str(tmp_path / "cache"), "--run", str(run), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    _cache(tmp_path, tiny_llama, "fp16", top_k=16)  # the same run scored on the fp16 cache of the same data
    assert main(["eval", "--cache", str(tmp_path / "fp16"), "--run", str(run), "--json"]) == 0
    fp16 = json.loads(capsys.readouterr().out)
    assert result["kl"] == pytest.approx(fp16["kl"], rel=1e-2, abs=1e-3)
    assert result["top1_agreement"] == fp16["top1_agreement"]


def test_logprob_values_need_topk_logits(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(4))
    assert main(["precompute", "--teacher", str(tiny_llama), "--data", str(data), "--out", str(tmp_path / "c"),
                 "--full-logits", "--topk-values", "logprob", "--logprob-tolerance", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "topk_values: logprob stores top-k logits, and this run caches full logits" in err
    assert "logprob_tolerance: got 0.0, expected a value in [0.001, 1]" in err and not (tmp_path / "c").exists()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_sampled_kl_is_unbiased(temperature: float) -> None:
    """Stage one's sampler and stage two's estimator together: the mean over many draws is the exact KL, on a small
    vocabulary, while any one draw of N=4 is far from it."""
    from kdcache.stages.targets.logits import LogitSettings, get
    from kdcache.stages.targets.logits.sampled_torch import capture, sampled_kl

    torch.manual_seed(0)
    vocab, tokens, repeats = 7, 400, 100
    draws = LogitSettings(get("sampled"), samples=4, sample_temperature=temperature)  # --logits sampled:4
    teacher, student = torch.randn(vocab) * 2, torch.randn(vocab) * 2
    exact = float(kd_kl(student[None, None], teacher[None, None], torch.ones(1, 1), temperature))
    mask = torch.ones(1, tokens)
    estimates = []
    for seed in range(repeats):
        drawn = capture(teacher.expand(tokens, vocab), draws, torch.Generator().manual_seed(seed))
        assert (drawn["logits/sample_counts"].sum(-1) == 4).all()
        estimates.append(float(sampled_kl(student.expand(1, tokens, vocab), drawn["logits/sample_ids"][None],
                                          drawn["logits/sample_counts"][None], drawn["logits/sample_logp"][None],
                                          mask, temperature)))
    mean, error = np.mean(estimates), np.std(estimates) / np.sqrt(repeats)
    assert abs(mean - exact) < 4 * error + 1e-6, (mean, exact, error)
    single = capture(teacher[None], draws, torch.Generator().manual_seed(1))
    one = float(sampled_kl(student[None, None], single["logits/sample_ids"][None], single["logits/sample_counts"][None],
                           single["logits/sample_logp"][None], torch.ones(1, 1), temperature))
    assert one != pytest.approx(exact, abs=1e-3)


def test_a_sampled_cache_trains_at_its_own_temperature_only(tiny_llama: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    reader = _cache(tmp_path, tiny_llama, "cache", logits_mode="sampled:12", sample_temperature=2.0)
    first = reader[0]
    assert first["logits/sample_counts"].sum(-1).tolist() == [12] * len(first["input_ids"])
    again = _cache(tmp_path, tiny_llama, "again", logits_mode="sampled:12", sample_temperature=2.0)
    np.testing.assert_array_equal(again[0]["logits/sample_ids"], first["logits/sample_ids"])  # reruns draw alike
    reseeded = _cache(tmp_path, tiny_llama, "reseeded", logits_mode="sampled:12", sample_temperature=2.0, seed=1)
    assert not np.array_equal(reseeded[0]["logits/sample_ids"], first["logits/sample_ids"])  # the seed is used
    assert (first["logits/sample_counts"] > 0).sum(-1).max() > 1  # real draws, not one id repeated
    argv = ["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--max-steps", "2",
            "--batch-size", "4", "--gamma", "0", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "run1"), "--temperature", "1"]) == 2
    assert "temperature 1.0: the KL needs the temperature the cache's samples were drawn at, 2.0" in \
        capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "run2"), "--temperature", "2"]) == 0
    metrics = [json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()]
    assert any("sampled_kl" in m for m in metrics)
    assert all(np.isfinite(m["sampled_kl"]) for m in metrics if "sampled_kl" in m)
    capsys.readouterr()
    assert main(["eval", "--cache", str(tmp_path / "cache"), "--run", str(tmp_path / "run2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kl_form"] == "sampled estimate (unbiased) at T=2"


def test_full_vocabulary_terms_in_chunks_are_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every loss over the vocabulary (CE, KL from full logits or a head, top-k with the leftover bucket, the
    sampled estimate), taken 3 valid tokens at a time with recomputation, has the value and the gradient of one
    pass."""
    from kdcache.stages.targets.logits.sampled_torch import sampled_kl
    from kdcache.stages.targets.logits.topk_torch import topk_kl
    from kdcache.stages.targets.logits.vocab import loss_rows
    from kdcache.stages.train.losses.logits import causal_ce, token_ce

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    teacher = hidden @ weight.T
    values, ids = teacher.topk(4, -1)
    counts = torch.randint(0, 3, (2, 5, 4))
    ids_long = torch.randint(0, 11, (2, 5))

    def run() -> list[torch.Tensor]:
        z_s = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        terms = [kd_kl(z_s, teacher, mask, 2.0), head_kl(z_s, hidden, lambda h: h @ weight.T, mask, 2.0),
                 topk_kl(z_s, values, ids, mask, torch.logsumexp(teacher, -1), variant="other"),
                 sampled_kl(z_s, ids, counts, values.log_softmax(-1), mask), causal_ce(z_s, ids_long, mask),
                 token_ce(z_s, ids_long, mask)]
        torch.stack(terms).sum().backward()
        return [t.detach() for t in terms] + [z_s.grad]

    whole = run()
    monkeypatch.setattr(loss_rows, "LOSS_CHUNK", 3)
    for a, b in zip(whole, run()):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(whole[0], whole[1])


def test_a_sampled_cache_sets_the_temperature_when_none_is_given(tiny_llama: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    reader = _cache(tmp_path, tiny_llama, "cache", logits_mode="sampled:8")
    assert reader.spec.sample_temperature == 1.0  # stage one's default; stage two's own default is 2
    run = tmp_path / "run"
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out", str(run),
                 "--max-steps", "1", "--batch-size", "4", "--gamma", "0", "--quiet"]) == 0
    first = capsys.readouterr().err.splitlines()[:3]
    assert any("training at temperature 1, the cache's sampling temperature (--temperature not given)" in line
               for line in first), first
    assert json.loads((run / "options.json").read_text())["temperature"] == 1.0
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out",
                 str(tmp_path / "other"), "--temperature", "2", "--gamma", "0"]) == 2  # given and different
    assert "temperature 2.0: the KL needs the temperature the cache's samples were drawn at, 1.0" in \
        capsys.readouterr().err


def test_a_head_cache_under_umask_022_reads_for_every_user(tiny_llama: Path, tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess
    import tempfile

    from kdcache.storage import verify_cache

    shared = Path(tempfile.mkdtemp(prefix="kdcache-shared-"))  # outside pytest's 0700 folder: others may enter
    shared.chmod(0o755)
    previous = os.umask(0o022)
    try:
        _cache(shared, tiny_llama, "cache", logits_mode="head")
        root = shared / "cache"
        for path in [root, *root.rglob("*")]:
            want = 0o755 if path.is_dir() else 0o644  # others may enter every folder and read every file
            assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))
        if os.geteuid() == 0:  # read every file as another user would (nobody), not only by the mode bits
            read = subprocess.run(["find", str(root), "-type", "f", "-exec", "cat", "{}", "+"], user=65534,
                                  group=65534, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert read.returncode == 0, read.stderr.decode()
        listed = json.loads((root / "manifest.json").read_text())["files"]
        assert {"teacher_head/head.safetensors", "teacher_head/head.json", "tokenizer/tokenizer.json"} <= set(listed)
        assert verify_cache(root).ok
        weights = root / "teacher_head" / "head.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
        report = verify_cache(root)  # caught before training, wherever the cache was copied
        assert not report.ok and any("teacher_head/head.safetensors" in str(p) for p in report.problems)
    finally:
        os.umask(previous)
        shutil.rmtree(shared, ignore_errors=True)
