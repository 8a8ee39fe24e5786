"""Shared helpers of the stage-two tests: tiny teachers and students, and caches written from real outputs.

``write_cache`` runs a tiny teacher over short texts and writes its targets with ``storage.CacheWriter``,
the way stage one does, so these tests need nothing from ``stages.precompute`` (stage two never imports it).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kdcache.stages.common.fingerprints import config_fingerprint, tokenizer_fingerprint, weights_fingerprint
from kdcache.storage.folders import put_folder
from tests.helpers.tiny_models import sample_texts


def teacher_outputs(teacher_dir: str | Path, texts: list[str], *, max_length: int = 24) -> list[dict[str, Any]]:
    """Per text: ``input_ids [L]``, ``hidden [N+1, L, d]``, ``attention [N, H, L, L]``, ``logits [L, V]``."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    config = json.loads((Path(teacher_dir) / "config.json").read_text())
    arch = (config.get("architectures") or ["Model"])[0]
    cls = AutoModelForCausalLM if "CausalLM" in arch or "LMHead" in arch else (
        AutoModelForMaskedLM if "MaskedLM" in arch else AutoModel)
    model = cls.from_pretrained(str(teacher_dir), attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tok(text, truncation=True, max_length=max_length)["input_ids"]
            res = model(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
            logits = getattr(res, "logits", None)
            out.append({"input_ids": np.asarray(ids, dtype=np.int64),
                        "hidden": torch.stack(res.hidden_states)[:, 0].numpy(),
                        "attention": torch.stack(res.attentions)[:, 0].numpy(),
                        "logits": None if logits is None else logits[0].numpy()})
    return out


def write_cache(teacher_dir: str | Path, out: str | Path, *, num_sequences: int = 48, sequences_per_shard: int = 8,
                hidden_layers: tuple[int, ...] | None = None, attention_layers: tuple[int, ...] | None = None,
                logits: str | None = "topk", top_k: int = 8, dtype: str = "fp16", backend: str = "zarr",
                max_length: int = 24, seed: int = 0) -> Path:
    """Write a complete cache of ``teacher_dir``'s targets on ``num_sequences`` sample texts.

    Defaults: every hidden layer (0..N), every attention layer (1..N), top-k logits when the teacher has a head.
    """
    from transformers import AutoConfig, AutoTokenizer

    from kdcache.storage import CacheSpec, CacheWriter

    config = AutoConfig.from_pretrained(str(teacher_dir))
    depth = int(config.num_hidden_layers)
    hidden_layers = tuple(range(depth + 1)) if hidden_layers is None else hidden_layers
    attention_layers = tuple(range(1, depth + 1)) if attention_layers is None else attention_layers
    records = teacher_outputs(teacher_dir, sample_texts(num_sequences, seed=seed), max_length=max_length)
    if records[0]["logits"] is None:
        logits = None
    vocab = int(config.vocab_size)
    spec = CacheSpec(num_sequences=num_sequences, backend=backend, hidden_layers=hidden_layers,
                     attention_layers=attention_layers, logits=logits, top_k=top_k if logits == "topk" else 0,
                     vocab_size=vocab if logits else 0, dtype=dtype, sequences_per_shard=sequences_per_shard)
    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    fingerprints = {
        "teacher": {"name_or_path": str(teacher_dir), "revision": None, "config_hash": config_fingerprint(config),
                    "weights_hash": weights_fingerprint(teacher_dir)},
        "tokenizer": tokenizer_fingerprint(tok),
        "data": {"source": "sample_texts", "split": None, "num_sequences": num_sequences},
        "settings": {"max_length": max_length, "layers": list(hidden_layers), "dtype": dtype},
    }
    out = Path(out)
    with CacheWriter(out, spec, fingerprints) as writer:
        for shard in range(spec.num_shards):
            start, stop = spec.shard_range(shard)
            writer.write_shard(shard, [_sequence(records[i], spec) for i in range(start, stop)])
        with tempfile.TemporaryDirectory() as saved:  # as stage one saves it: listed in the manifest
            tok.save_pretrained(saved)
            put_folder(writer.store, "tokenizer", Path(saved))
        writer.finalize()
    return out


def _sequence(rec: dict[str, Any], spec: Any) -> dict[str, np.ndarray]:
    seq = {"input_ids": rec["input_ids"].astype(np.int32)}
    for j in spec.hidden_layers:
        seq[f"hidden/{j}"] = rec["hidden"][j].astype(np.float32)
    for j in spec.attention_layers:
        seq[f"attention/{j}"] = rec["attention"][j - 1].astype(np.float32)
    if spec.logits == "full":
        seq["logits/full"] = rec["logits"].astype(np.float32)
    elif spec.logits == "topk":
        z = torch.from_numpy(rec["logits"]).float()
        values, ids = z.topk(spec.top_k, dim=-1)
        seq["logits/topk_values"] = values.numpy()
        seq["logits/topk_ids"] = ids.numpy().astype(np.int64)
        seq["logits/lse"] = torch.logsumexp(z, dim=-1).numpy()
    return seq


def make_student_config(path: str | Path, teacher_dir: str | Path, **overrides: Any) -> Path:
    """Write a ``config.json``-only student folder: the teacher's config with ``overrides`` (random init)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(teacher_dir))
    for key, value in overrides.items():
        setattr(config, key, value)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(path))
    return path


def precompute_cache(teacher_dir: str | Path, out: str | Path, *, num_sequences: int = 48, max_length: int = 24,
                     extra: tuple[str, ...] = ("--features", "hidden,attention,logits", "--top-k", "8")) -> Path:
    """Write a cache with stage one itself (``kdcache precompute``) over ``num_sequences`` sample texts."""
    from kdcache.pipeline.cli import main

    out = Path(out)
    data = out.parent / f"{out.name}-texts.txt"
    data.write_text("\n".join(sample_texts(num_sequences)) + "\n")
    argv = ["precompute", "--teacher", str(teacher_dir), "--data", str(data), "--out", str(out), "--max-length",
            str(max_length), "--sequences-per-shard", "8", "--batch-size", "16", "--no-progress", *extra]
    if main(argv) != 0:
        raise RuntimeError(f"precompute failed: {argv}")
    return out
