"""What a sealed manifest costs to open (issue 24): ``read_manifest`` with its crc32c checked, against parsing
the same file alone, on a manifest of many shards (every reader and every training rank opens it once).

    python benchmarks/bench_manifest.py --shards 2000 --repeats 5

Sides alternate, best of ``--repeats`` each; prints the manifest's size, both times and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from kdcache.storage import CacheSpec, CacheWriter
from kdcache.storage.core.canonical import SEAL, canonical_json, sealed
from kdcache.storage.core.stores import open_store
from kdcache.storage.schema.manifest import Manifest, load_json, read_manifest

FINGERPRINTS = {"teacher": {"name_or_path": "bench"}, "tokenizer": {"vocab_hash": "sha256:00"},
                "data": {"source": "bench"}, "settings": {"max_length": 8}}


def big_manifest(root: Path, shards: int) -> int:
    """A real one-shard cache whose manifest is then widened to ``shards`` copies of its record; returns bytes."""
    spec = CacheSpec(num_sequences=3, backend="zarr", hidden_layers=(0, 2), attention_layers=(), logits=None,
                     vocab_size=300, sequences_per_shard=3)
    rng = np.random.default_rng(0)
    sequences = [{"input_ids": rng.integers(0, 300, n), "hidden/0": rng.normal(size=(n, 8)).astype(np.float32),
                  "hidden/2": rng.normal(size=(n, 8)).astype(np.float32)} for n in (4, 5, 6)]
    with CacheWriter(root, spec, FINGERPRINTS) as writer:
        writer.write_shard(0, sequences)
        writer.finalize()
    data = json.loads((root / "manifest.json").read_text())
    data.pop(SEAL)
    data["shards"] = [dict(copy.deepcopy(data["shards"][0]), index=i) for i in range(shards)]
    raw = canonical_json(sealed(data))
    (root / "manifest.json").write_bytes(raw)
    return len(raw)


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kdcache-bench-manifest-"))
    size = big_manifest(root, args.shards)
    sides = {"parse only": lambda: Manifest.from_dict(load_json(open_store(root), "manifest.json", "manifest")[1]),
             "read_manifest (seal checked)": lambda: read_manifest(root)}
    best = {name: float("inf") for name in sides}
    for _ in range(args.repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    print(f"manifest of {args.shards} shards, {size / 1e6:.1f} MB")
    for name, seconds in best.items():
        print(f"  {name:<30} {seconds * 1e3:7.0f} ms")
    print(f"  ratio {best['read_manifest (seal checked)'] / best['parse only']:.2f}")


if __name__ == "__main__":
    main()
