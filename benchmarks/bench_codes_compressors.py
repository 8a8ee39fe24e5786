"""Compressors for a hidden codec's codes, chosen by measurement on their real output (issue 43).

Caches MiniLM's layers 2, 4, 6 (the demo's teacher, 600 stdlib sentences) with ``--hidden-codec int8`` and ``pca8``,
reads the codes back as the compressor sees them (pca8's column-major, after its row shuffle), and times each
Blosc configuration on one core: ratio, encode and decode MB/s, and bytes saved per CPU-second, best of three.

Usage: ``python benchmarks/bench_codes_compressors.py [--sentences 600]``; prints a markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numcodecs
import numpy as np
import zarr
from numcodecs import Blosc, Shuffle

CONFIGS = [("zstd", 1, 0), ("zstd", 1, 1 << 20), ("zstd", 3, 1 << 20), ("zstd", 5, 0), ("zstd", 5, 1 << 20),
           ("zstd", 9, 1 << 20), ("lz4", 5, 0)]
LAYERS = (2, 4, 6)


def cache(codec: str, data: Path, out: Path) -> Path:
    """``kdcache precompute`` of the demo's teacher with ``--hidden-codec codec``."""
    from kdcache.pipeline.demo import teacher_path

    rank = ["--hidden-rank", "384"] if codec == "pca8" else []
    subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", str(teacher_path()), "--data",
                    str(data), "--out", str(out), "--layers", ",".join(map(str, LAYERS)), "--hidden-codec", codec,
                    *rank, "--no-progress", "--quiet"], check=True)
    return out


def codes(root: Path, column_major: bool) -> bytes:
    """Every layer's codes of shard 0, as the codes' compressor sees them."""
    arrays = [zarr.open_array(str(root / "shards" / "shard-000000" / "hidden" / str(j)), mode="r")[:] for j in LAYERS]
    flat = np.ascontiguousarray(np.concatenate(arrays)).tobytes()
    return Shuffle(elementsize=arrays[0].shape[1]).encode(flat) if column_major else flat


def measure(data: bytes) -> list[dict[str, float | str]]:
    """One row per configuration (one thread)."""
    numcodecs.blosc.set_nthreads(1)
    rows: list[dict[str, float | str]] = []
    for cname, level, block in CONFIGS:
        compressor = Blosc(cname=cname, clevel=level, shuffle=0, blocksize=block)
        best, out = float("inf"), b""
        for _ in range(3):
            start = time.process_time()
            out = compressor.encode(data)
            best = min(best, time.process_time() - start)
        start = time.process_time()
        compressor.decode(out)
        decode = max(time.process_time() - start, 1e-9)
        rows.append({"compressor": f"{cname}-{level}, blocks {block >> 10 or 'auto'} KiB",
                     "ratio": len(data) / len(out), "encode_mb_s": len(data) / best / 1e6,
                     "decode_mb_s": len(data) / decode / 1e6, "saved_mb_per_cpu_s": (len(data) - len(out)) / best / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=600)
    args = parser.parse_args()
    from kdcache.pipeline.demo import stdlib_sentences, write_jsonl

    root = Path(tempfile.mkdtemp(prefix="kdcache-bench-codes-"))
    data = write_jsonl(stdlib_sentences(limit=args.sentences), root / "d.jsonl")
    print("| codec | compressor | ratio | encode MB/s a core | decode MB/s | saved MB per CPU-s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for codec, column in (("int8", False), ("pca8", True)):
        for r in measure(codes(cache(codec, data, root / codec), column)):
            print(f"| {codec} | {r['compressor']} | {r['ratio']:.3f} | {r['encode_mb_s']:.1f} | {r['decode_mb_s']:.0f} "
                  f"| {r['saved_mb_per_cpu_s']:.1f} |")


if __name__ == "__main__":
    main()
