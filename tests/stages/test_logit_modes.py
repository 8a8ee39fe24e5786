"""Logit modes of a cache (issue 11): exact teacher logits from the cached last layer and a copy of the LM head.

A tiny random Llama teacher; the reference is the same data cached with full logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.precompute import run_precompute
from kdcache.stages.precompute.options import PrecomputeOptions
from kdcache.stages.train.losses import head_kl, kd_kl
from kdcache.stages.train.streaming import collate, to_device
from kdcache.stages.train.teacher_head import load_teacher_head
from kdcache.storage import CacheReader
from kdcache.storage.errors import KdcacheError
from kdcache.storage.stores import open_store
from tests.helpers.tiny_models import make_tiny_llama, sample_texts, write_text_dataset


def _cache(tmp_path: Path, teacher: Path, name: str, **overrides: Any) -> CacheReader:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_text_dataset(data, sample_texts(12, seed=5))
    opts = dict(teacher=str(teacher), data=str(data), out=str(tmp_path / name), max_length=40, batch_size=4,
                layers=("1",), progress=False)
    run_precompute(PrecomputeOptions(**{**opts, **overrides}))
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
    # fp16 storage of the hidden state (vs fp16 logits in the full cache) is the only difference.
    torch.testing.assert_close(rebuilt, full["logits/full"][batch["mask"].bool()], rtol=0, atol=2e-2)


def test_training_and_eval_on_a_head_cache(tiny_llama: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    _cache(tmp_path, tiny_llama, "cache", logits_mode="head", sequences_per_shard=6)
    run = tmp_path / "run"
    assert main(["train", "--cache", str(tmp_path / "cache"), "--student", str(tiny_llama), "--out", str(run),
                 "--max-steps", "2", "--batch-size", "4", "--gamma", "0", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "teacher head from the cache: 0.0M parameters" in err and "applied to cached layer 3" in err
    assert main(["eval", "--cache", str(tmp_path / "cache"), "--run", str(run), "--json"]) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    assert result["kl_form"] == "full" and 0 <= result["top1_agreement"] <= 1 and result["kl"] >= 0


def test_a_damaged_or_missing_head_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    reader = _cache(tmp_path, tiny_llama, "cache", logits_mode="head")
    weights = tmp_path / "cache" / "teacher_head" / "head.safetensors"
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
