"""``--logits sampled:12`` at V = 128,256 through a real ``kdcache precompute`` (issue 32, finding 7).

``bench_logits.py`` measures each logit mode by writing one shard of 4,096 tokens (16 rows of 256 random ids) of
a random Llama-shaped teacher (d = 256); a user's cache is many shorter rows, in shards, of real text. This
benchmark writes the latter: a random Llama with Llama-3's vocabulary over ``--sequences`` sample texts, stored by
stage one itself, and reports bytes per token per array of the logits (ids, counts, log-probs), read from the
manifest, for the teacher widths and shard sizes given.

Run: ``.venv/bin/python benchmarks/bench_sampled.py [--sequences 160] [--hidden 64 256] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 128_256


def teacher(path: Path, hidden: int) -> Path:
    """A random Llama of ``VOCAB`` outputs and a small BPE tokenizer (its ids are the first few hundred)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_models import make_tiny_llama

    make_tiny_llama(path, layers=2, hidden=hidden)  # the tokenizer (and a config to replace)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * hidden,
                                         max_position_embeddings=512, tie_word_embeddings=False))
    model.save_pretrained(str(path))
    return path


def measure(model: Path, data: Path, out: Path, per_shard: int) -> dict[str, Any]:
    from kdcache.pipeline.cli import main
    from kdcache.storage import CacheReader
    from kdcache.storage.schema.manifest import summarize_arrays

    code = main(["precompute", "--teacher", str(model), "--data", str(data), "--out", str(out), "--features",
                 "logits", "--logits", "sampled:12", "--max-length", "128", "--sequences-per-shard", str(per_shard),
                 "--no-progress", "--quiet"])
    assert code == 0, code
    reader = CacheReader(out)
    tokens = reader.num_tokens
    arrays = summarize_arrays(reader.spec, reader.records)
    per_array = {name: round(info["stored_bytes"] / tokens, 2) for name, info in arrays.items()
                 if name.startswith("logits/")}
    return {"tokens": int(tokens), "shards": len(reader.records), "per_array": per_array,
            "logits_bytes_per_token": round(sum(per_array.values()), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=160)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--per-shard", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from tests.helpers.tiny_models import sample_texts, write_text_dataset

    rows = []
    with tempfile.TemporaryDirectory(prefix="kdcache-bench-sampled-") as scratch:
        root = Path(scratch)
        os.environ.setdefault("KDCACHE_ROWS", str(root / "rows"))
        data = write_text_dataset(root / "texts.jsonl", sample_texts(args.sequences, seed=11))
        for hidden in args.hidden:
            model = teacher(root / f"llama-{hidden}", hidden)
            for per_shard in args.per_shard:
                row = {"hidden": hidden, "sequences_per_shard": per_shard,
                       **measure(model, data, root / f"cache-{hidden}-{per_shard}", per_shard)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
