"""A cache of random dense teacher logits (``--logits full``) written by the real writer, without a teacher: for
tests of what stage two's feed holds of ``[B, L, V]`` targets (issue 63)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kdcache.storage import CacheSpec, CacheWriter


def write_full_cache(out: Path, lengths: list[int], vocab: int, per_shard: int, dtype: str = "fp16",
                     backend: str = "zarr") -> Path:
    """A cache of random ``logits/full [L, vocab]`` rows (and token ids), written by the real writer."""
    spec = CacheSpec(num_sequences=len(lengths), sequences_per_shard=per_shard, hidden_layers=(),
                     attention_layers=(), logits="full", vocab_size=vocab, dtype=dtype, backend=backend)
    fingerprints = {"teacher": {"name_or_path": "random", "revision": None, "config_hash": "sha256:aa",
                                "weights_hash": "sha256:bb"},
                    "tokenizer": {"vocab_hash": "sha256:11", "vocab_size": vocab, "special_tokens": {}},
                    "data": {"source": "random", "split": None, "num_sequences": len(lengths)}, "settings": {}}
    rng = np.random.default_rng(0)
    with CacheWriter(out, spec, fingerprints) as writer:
        for shard in range(spec.num_shards):
            start, stop = spec.shard_range(shard)
            writer.write_shard(shard, [{"input_ids": rng.integers(0, vocab, n),
                                        "logits/full": (rng.normal(size=(n, vocab)) * 4).astype(np.float32)}
                                       for n in lengths[start:stop]])
        writer.finalize()
    return out
