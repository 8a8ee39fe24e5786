"""Fidelity of stage one: what lands in the cache is what the teacher computes, within fp16 rounding.

The reference runs the teacher the plain HF way, one sequence at a time (no padding at all), with
``output_hidden_states`` and ``output_attentions``; the cache was written from length-bucketed, padded batches
through hooks. Agreement therefore also shows that padding never leaks into valid tokens, and that layer N is
HF's ``hidden_states[N]`` (after GPT-2's ``ln_f`` / Llama's ``norm``), not the last block's raw output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheReader, to_float32
from tests.helpers.tiny_models import sample_texts, write_text_dataset

RTOL, ATOL = 2e-3, 2e-5  # fp16 keeps 11 significant bits: relative rounding error <= 2**-11


def _precompute(tmp_path: Path, teacher: Path, texts: list[str], **overrides: Any) -> tuple[dict, CacheReader]:
    data = write_text_dataset(tmp_path / "data.jsonl", texts)
    opts = dict(teacher=str(teacher), data=str(data), out=str(tmp_path / "cache"), max_length=48,
                batch_size=4, sequences_per_shard=8, progress=False)
    opts.update(overrides)
    summary = run_precompute(PrecomputeOptions.of(**opts))
    return summary, CacheReader(tmp_path / "cache")


def _reference(teacher: Path, ids: np.ndarray, cls_name: str) -> Any:
    import transformers

    cls = getattr(transformers, cls_name)
    model = cls.from_pretrained(str(teacher), attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids[None].astype(np.int64)), output_hidden_states=True, output_attentions=True)


def _close(cached: np.ndarray, ref: torch.Tensor | np.ndarray, what: str, dtype: str = "fp16") -> None:
    got = to_float32(cached, dtype)
    want = ref.numpy() if isinstance(ref, torch.Tensor) else ref
    rtol = RTOL if dtype == "fp16" else 2 ** -7
    np.testing.assert_allclose(got, want, rtol=rtol, atol=ATOL, err_msg=what)


def _check_sequences(reader: CacheReader, teacher: Path, cls_name: str, count: int = 6) -> None:
    spec = reader.spec
    for i in np.linspace(0, len(reader) - 1, count).astype(int):
        item = reader[int(i)]
        ref = _reference(teacher, item["input_ids"], cls_name)
        for j in spec.hidden_layers:
            _close(item[f"hidden/{j}"], ref.hidden_states[j][0], f"seq {i} hidden/{j}", spec.dtype)
        for j in spec.attention_layers:
            want = ref.attentions[j - 1][0]
            if spec.attention_heads is not None:
                want = want[list(spec.attention_heads)]
            if spec.attention_triangle:
                want = torch.tril(want)
            _close(item[f"attention/{j}"], want, f"seq {i} attention/{j}", spec.dtype)
        if spec.logits == "topk":
            _check_topk(item, ref.logits[0], spec.top_k)
        elif spec.logits == "full":
            _close(item["logits/full"], ref.logits[0], f"seq {i} logits/full", spec.dtype)


def _check_topk(item: dict[str, np.ndarray], logits: torch.Tensor, k: int) -> None:
    """Cached top-k ids/values/lse give the exact full-vocabulary log-probs of the top-k tokens."""
    values = to_float32(item["logits/topk_values"], "fp16")  # [L, k]
    ids = item["logits/topk_ids"].astype(np.int64)  # [L, k]
    lse = item["logits/lse"]  # [L] float32
    ref = logits.numpy()
    ref_lse = torch.logsumexp(logits, -1).numpy()
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
    assert (np.diff(values, axis=1) <= 0).all(), "top-k values must be sorted descending"
    ref_logprobs = torch.log_softmax(logits, -1).numpy()
    np.testing.assert_allclose(values - lse[:, None], np.take_along_axis(ref_logprobs, ids, 1), rtol=0,
                               atol=np.abs(values).max() * 2 ** -10 + 1e-5)
    kth = np.sort(ref, axis=1)[:, -k]  # the k-th largest logit: every cached value must reach it
    assert (values[:, -1] >= kth - np.abs(kth) * 2 ** -10 - 1e-5).all()
    assert all(len(set(row)) == k for row in ids.tolist()), "top-k ids must be distinct"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_teacher_hidden_attention_topk(family: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    teacher = request.getfixturevalue(f"tiny_{family}")
    texts = sample_texts(20, seed=1)
    summary, reader = _precompute(tmp_path, teacher, texts, features=("hidden", "attention", "logits"), top_k=16)
    assert summary["status"] == "complete" and reader.spec.hidden_layers == (0, 1, 2, 3)
    assert reader.spec.attention_layers == (1, 2, 3)
    _check_sequences(reader, teacher, "AutoModelForCausalLM")


def test_no_padding_reaches_disk(tiny_gpt2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    texts = sample_texts(20, seed=2)
    summary, reader = _precompute(tmp_path, tiny_gpt2, texts, layers=("2",), features=("hidden",))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "cache" / "tokenizer"))
    expected = [tok(t, truncation=True, max_length=48)["input_ids"] for t in texts]
    assert reader.num_tokens == summary["cache_tokens"] == sum(len(e) for e in expected)
    for i, ids in enumerate(expected):
        item = reader[i]
        assert item["input_ids"].tolist() == ids  # data order kept despite length bucketing
        assert item["hidden/2"].shape == (len(ids), 32)


def test_minilm_real_weights_hidden_and_attention(minilm: Path, tmp_path: Path) -> None:
    texts = sample_texts(12, seed=3)
    _, reader = _precompute(tmp_path, minilm, texts, layers=("0", "3", "6"), features=("hidden", "attention"),
                            heads=(0, 5, 11))
    assert reader.spec.attention_layers == (3, 6) and reader.spec.attention_heads == (0, 5, 11)
    assert reader.spec.logits is None
    _check_sequences(reader, minilm, "AutoModel", count=4)


def test_encoder_full_logits_and_bf16(tiny_bert: Path, tmp_path: Path) -> None:
    texts = sample_texts(10, seed=4)
    _, reader = _precompute(tmp_path, tiny_bert, texts, full_logits=True, dtype="bf16", layers=("all",))
    assert reader.spec.logits == "full" and reader.spec.dtype == "bf16"
    _check_sequences(reader, tiny_bert, "AutoModelForMaskedLM", count=3)


def test_causal_triangle_and_negative_layers(tiny_llama: Path, tmp_path: Path) -> None:
    texts = sample_texts(10, seed=5)
    _, reader = _precompute(tmp_path, tiny_llama, texts, layers=("-1",), features=("hidden", "attention"),
                            triangle=True, heads=(1, 3))
    assert reader.spec.hidden_layers == (3,) and reader.spec.attention_triangle
    _check_sequences(reader, tiny_llama, "AutoModelForCausalLM", count=3)


def test_concat_packing_fills_fixed_blocks(tiny_gpt2: Path, tmp_path: Path) -> None:
    texts = sample_texts(30, seed=6)
    _, reader = _precompute(tmp_path, tiny_gpt2, texts, packing="concat", max_length=32, layers=("1",),
                            features=("hidden",))
    lengths = [len(reader[i]["input_ids"]) for i in range(len(reader))]
    assert all(n == 32 for n in lengths[:-1]) and 1 <= lengths[-1] <= 32
    eos = 1  # "</s>" is the second special token of the tiny BPE tokenizer
    assert sum(int((reader[i]["input_ids"] == eos).sum()) for i in range(len(reader))) == 30


def test_chunked_logits_equal_the_whole_batch_at_once(tiny_llama: Path, tmp_path: Path) -> None:
    """Top-k through the LM head in chunks of 7 valid tokens gives what one pass over the padded batch gives."""
    texts = sample_texts(10, seed=8)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, chunked = _precompute(tmp_path / "a", tiny_llama, texts, layers=("1",), features=("logits",), top_k=8,
                             logits_chunk=7)
    _, whole = _precompute(tmp_path / "b", tiny_llama, texts, layers=("1",), features=("logits",), top_k=8,
                           logits_chunk=0)
    for i in range(len(whole)):
        a, b = chunked[i], whole[i]
        np.testing.assert_array_equal(a["logits/topk_ids"], b["logits/topk_ids"])
        np.testing.assert_allclose(a["logits/lse"], b["logits/lse"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(to_float32(a["logits/topk_values"], "fp16"),
                                   to_float32(b["logits/topk_values"], "fp16"), rtol=1e-3, atol=1e-3)


def test_a_head_that_is_not_the_output_embedding_falls_back(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Granite divides its logits by logits_scaling after the head: the first-batch check catches it, and the
    cached top-k are the model's own."""
    from transformers import GraniteConfig, GraniteForCausalLM

    from tests.helpers.tiny_models import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(tmp_path / "granite")
    cfg = GraniteConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=64, logits_scaling=4.0,
                        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GraniteForCausalLM(cfg).save_pretrained(str(tmp_path / "granite"))
    _, reader = _precompute(tmp_path, tmp_path / "granite", sample_texts(6, seed=9), layers=("1",),
                            features=("hidden", "logits"), top_k=8)
    assert "computing them with the full forward (no chunking)" in capsys.readouterr().err
    _check_sequences(reader, tmp_path / "granite", "AutoModelForCausalLM", count=3)
