"""The shared backend suite's data (tests/storage/test_storage_backends.py), also used by the object-store, format
and plugin tests: random teacher outputs in the writer's input format, what a reader must return for them
(computed without storage.encode), the fingerprints a test cache records, and a harness around the cache CLI."""

from __future__ import annotations

import argparse
import contextlib
import io

import numpy as np

from kdcache.pipeline.cli.commands import cache as cache_cmd
from kdcache.storage import CacheSpec
from kdcache.storage.core.errors import KdcacheError
from tests.storage._seq2seq_suite import stored

D, HEADS = 8, 4
FINGERPRINTS = {
    "teacher": {"name_or_path": "tiny-bert", "revision": "r1", "config_hash": "sha256:aa", "weights_hash": "sha256:bb"},
    "tokenizer": {"vocab_hash": "sha256:1111", "vocab_size": 300, "special_tokens": {"pad_token": "[PAD]"}},
    "data": {"source": "stdlib-docstrings", "split": "train", "input_ids_hash": "sha256:cc", "num_sequences": 7},
    "settings": {"max_length": 12, "packing": False, "format_version": 1},
}


def make_sequences(spec: CacheSpec, lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Random float32 teacher outputs in the writer's input format, one dict per sequence."""
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        item = {"input_ids": rng.integers(0, max(spec.vocab_size, 2), length)}
        if "loss_mask" in spec.token_arrays:
            item["loss_mask"] = rng.integers(0, 2, length)
        if "position_ids" in spec.token_arrays:  # two packed documents
            item["position_ids"] = np.concatenate([np.arange(length // 2), np.arange(length - length // 2)])
        for j in spec.hidden_layers:
            item[f"hidden/{j}"] = (rng.normal(size=(length, D)) * 3).astype(np.float32)
        for j in spec.attention_layers:
            scores = rng.random((HEADS, length, length)).astype(np.float32)
            item[f"attention/{j}"] = scores / scores.sum(-1, keepdims=True)
        if spec.logits == "full":
            item["logits/full"] = (rng.normal(size=(length, spec.vocab_size)) * 5).astype(np.float32)
        elif spec.logits == "sampled":
            item["logits/sample_ids"] = np.sort(rng.integers(0, spec.vocab_size, (length, spec.samples)), axis=1)
            item["logits/sample_counts"] = rng.integers(0, 4, (length, spec.samples))
            item["logits/sample_logp"] = -rng.random((length, spec.samples)).astype(np.float32) * 9
        elif spec.logits == "topk":
            values = rng.normal(size=(length, spec.top_k)).astype(np.float32)
            item["logits/topk_values"] = -np.sort(-values, axis=1)
            item["logits/topk_ids"] = rng.integers(0, spec.vocab_size, (length, spec.top_k))
            item["logits/lse"] = rng.normal(size=length).astype(np.float32)
            if spec.topk_values == "logprob":  # log-probabilities, no logsumexp
                item["logits/topk_values"] = np.sort(np.log(rng.random((length, spec.top_k))), axis=1)[:, ::-1]
                del item["logits/lse"]
        out.append(item)
    return out


def expected(spec: CacheSpec, item: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the reader must return for one input sequence, computed independently of storage.encode."""
    out = {"input_ids": item["input_ids"].astype(np.int32)}
    for name in spec.token_arrays:
        out[name] = item[name].astype(spec.array_dtype(name))
    for name, value in item.items():
        if name == "logits/topk_values" and spec.topk_values == "logprob":  # multiples of the step
            out[name] = np.rint(-value / spec.logprob_step).astype(np.float32) * np.float32(-spec.logprob_step)
        elif name.startswith("hidden/") or name in ("logits/full", "logits/topk_values", "logits/sample_logp"):
            out[name] = stored(spec, value)
        elif name.startswith("attention/"):
            attn = value if spec.attention_heads is None else value[list(spec.attention_heads)]
            if "position_ids" in spec.token_arrays:  # stored per document: nothing between documents survives
                docs = np.cumsum(item["position_ids"] == 0)
                attn = np.where(docs[:, None] == docs[None, :], attn, 0)
            out[name] = stored(spec, np.tril(attn) if spec.attention_triangle else attn)
    if spec.logits == "topk":
        out["logits/topk_ids"] = item["logits/topk_ids"]
        if "logits/lse" in item:
            out["logits/lse"] = item["logits/lse"]
    if spec.logits == "sampled":
        out["logits/sample_ids"] = item["logits/sample_ids"]
        out["logits/sample_counts"] = item["logits/sample_counts"].astype(np.uint8)
    return out


def run_cli(*argv: str) -> tuple[int, str]:
    """A tiny argparse harness around pipeline.cli.commands.cache (what pipeline/cli/__init__.py does)."""
    parser = argparse.ArgumentParser(prog="kdcache")
    cache_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            code = args.func(args)
        except KdcacheError as exc:
            print(f"error: {exc}")
            code = 2
    return code, buffer.getvalue()


