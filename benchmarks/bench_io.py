"""Cache I/O against plain zarr on the same arrays (issue 10): write, read, and one target out of five.

Two shapes:

- ``minilm``: the real all-MiniLM-L6-v2 activations over standard-library docstring sentences (as
  bench_storage.py): hidden layers 0-3 and top-64 logits of the tied head (V = 30,522);
- ``llama``: a synthetic Llama-shaped shard of 2,048 tokens: d = 4,096 hidden layers (fp16, normal values) and
  top-64 logits at V = 128,256 (sorted fp16 values, uint32 ids, fp32 logsumexp).

The baseline is plain zarr v3 writing the same flat, token-major arrays (what ``encode_shard`` produces) with the
same codec (Blosc lz4 + bitshuffle for activations, zstd for top-k) in big chunks (about 16 MiB decoded), one
group per shard, made durable the way kdcache's are (issue 26): every file, then every folder, fsynced, in a pool of
``storage.core.files._IO_THREADS`` threads (``--no-fsync`` for the earlier baseline without). kdcache's write is ``CacheWriter.write_shard`` on per-sequence fp16 arrays, so it
also pays what the baseline skips: concatenation, fp16 range checks, checksums, fsync and the commit. Reads are
a fresh ``CacheReader.read_shard`` per shard (page cache warm; arrays decode in parallel, one thread per core,
and again with one thread) against ``zarr.open_array(...)[:]`` per array, one after the other.
MB = 10**6 decoded bytes per second. Best of ``--repeats``, the two sides alternating.

Object storage: the MiniLM cache is also uploaded to a local S3-compatible server (moto's, on 127.0.0.1, as the
tests use) and read through s3fs; a training stream over each copy reports how long a step waits for its batch.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_io.py [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

# The repository root, for tests.helpers (the tiny models); kdcache itself is pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from bench_storage import stdlib_sentences, teacher_outputs, write_cache  # noqa: E402

from kdcache.storage import CacheReader, CacheSpec, encode_shard  # noqa: E402
from kdcache.storage.backends.zarr_backend import to_zarr_compressors  # noqa: E402

BIG_CHUNK = 16 << 20
V_LLAMA, D_LLAMA, TOP_K = 128_256, 4096, 64


def minilm_sequences(count: int) -> tuple[list[dict[str, np.ndarray]], int]:
    """Real MiniLM targets (hidden 0-6, top-64), fp16 as stage one hands them over; and the vocabulary."""
    seqs = teacher_outputs(stdlib_sentences(count))
    keep = [f"hidden/{j}" for j in range(4)] + ["input_ids", "logits/topk_values", "logits/topk_ids", "logits/lse"]
    return [{k: _fp16(k, s[k]) for k in keep} for s in seqs], 30_522


def llama_sequences(tokens: int, per_sequence: int, layers: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Synthetic Llama-shaped targets: ``layers`` hidden layers [L, 4096] and top-64 at V = 128,256."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(tokens // per_sequence):
        item = {"input_ids": rng.integers(0, V_LLAMA, per_sequence)}
        for j in range(layers):
            item[f"hidden/{j}"] = rng.normal(0, 2, (per_sequence, D_LLAMA)).astype(np.float16)
        values = np.sort(rng.normal(0, 3, (per_sequence, TOP_K)).astype(np.float32), axis=1)[:, ::-1]
        item["logits/topk_values"] = np.ascontiguousarray(values).astype(np.float16)
        item["logits/topk_ids"] = rng.integers(0, V_LLAMA, (per_sequence, TOP_K)).astype(np.uint32)
        item["logits/lse"] = (values[:, 0] + 2).astype(np.float32)
        out.append(item)
    return out


def _fp16(name: str, value: np.ndarray) -> np.ndarray:
    return value.astype(np.float16) if name.startswith("hidden/") or name == "logits/topk_values" else value


def make_spec(seqs: list[dict[str, np.ndarray]], vocab: int, per_shard: int, hidden: int) -> CacheSpec:
    return CacheSpec(num_sequences=len(seqs), hidden_layers=tuple(range(hidden)), logits="topk", top_k=TOP_K,
                     vocab_size=vocab, sequences_per_shard=per_shard)


def kdcache_read(root: Path, names: list[str] | None, threads: int | None = None) -> float:
    t0 = time.perf_counter()
    reader = CacheReader(root, decode_threads=threads)
    for k in reader.committed_shards:
        reader.read_shard(k, names)
    return time.perf_counter() - t0


def make_durable(group: Path) -> None:
    """fsync every file of a zarr group, then its folders, deepest first (what a crash-safe baseline pays)."""
    from concurrent.futures import ThreadPoolExecutor

    from kdcache.storage.core.files import _IO_THREADS, fsync_path

    paths = sorted(group.rglob("*"), key=lambda p: -len(p.parts))
    with ThreadPoolExecutor(_IO_THREADS) as pool:
        list(pool.map(fsync_path, [p for p in paths if p.is_file()]))
        list(pool.map(fsync_path, [p for p in paths if p.is_dir()] + [group, group.parent]))


def plain_write(root: Path, shards: list[dict[str, np.ndarray]], spec: CacheSpec, durable: bool = True) -> float:
    import zarr

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, arrays in enumerate(shards):
            path = str(root / f"shard-{k}")
            zarr.open_group(path, mode="w", zarr_format=3)
            for name, array in arrays.items():
                rows = max(1, min(len(array), BIG_CHUNK // max(1, array[0].nbytes)))
                zarr.create_array(path, name=name, data=array, chunks=(rows, *array.shape[1:]),
                                  compressors=to_zarr_compressors(spec.codec_for(name)), zarr_format=3)
            if durable:
                make_durable(root / f"shard-{k}")
    return time.perf_counter() - t0


def plain_read(root: Path, shards: list[dict[str, np.ndarray]], names: list[str] | None) -> float:
    import zarr

    t0 = time.perf_counter()
    for k, arrays in enumerate(shards):
        for name in names or arrays:
            np.asarray(zarr.open_array(str(root / f"shard-{k}" / name), mode="r")[:])
    return time.perf_counter() - t0


def best(repeats: int, sides: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Best wall time of each side over ``repeats`` rounds, sides alternating within a round."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            times[name].append(run())
    return {name: min(values) for name, values in times.items()}


def bench_shape(label: str, seqs: list[dict[str, np.ndarray]], vocab: int, per_shard: int, hidden: int,
                tmp: Path, repeats: int, durable: bool = True) -> list[str]:
    """One shape: write, read all, and top-k alone vs top-k out of a cache holding ``hidden`` more targets."""
    spec = make_spec(seqs, vocab, per_shard, hidden)
    shards = [encode_shard(spec, k, seqs[slice(*spec.shard_range(k))]).arrays for k in range(spec.num_shards)]
    decoded = sum(a.nbytes for shard in shards for a in shard.values())

    def fresh(name: str) -> Path:
        shutil.rmtree(tmp / name, ignore_errors=True)
        return tmp / name

    writes = best(repeats, {"kdcache": lambda: write_cache(fresh("kd"), spec, seqs),
                            "plain": lambda: plain_write(fresh("plain"), shards, spec, durable)})
    reads = best(repeats, {"kdcache": lambda: kdcache_read(tmp / "kd", None),
                           "kdcache, 1 thread": lambda: kdcache_read(tmp / "kd", None, threads=1),
                           "plain": lambda: plain_read(tmp / "plain", shards, None)})
    only = make_spec([{k: v for k, v in s.items() if not k.startswith("hidden/")} for s in seqs], vocab, per_shard, 0)
    write_cache(fresh("topk-only"), only, [{k: v for k, v in s.items() if not k.startswith("hidden/")} for s in seqs])
    topk = ["logits/topk_values", "logits/topk_ids", "logits/lse"]
    topk_bytes = sum(shard[n].nbytes for shard in shards for n in topk)
    one = best(repeats, {"of five": lambda: kdcache_read(tmp / "kd", ["logits"]),
                         "alone": lambda: kdcache_read(tmp / "topk-only", ["logits"])})
    mb = lambda nbytes, s: nbytes / s / 1e6  # noqa: E731
    return [
        f"| {label} | write{' (both fsync)' if durable else ''} | {mb(decoded, writes['kdcache']):,.0f} | {mb(decoded, writes['plain']):,.0f} | "
        f"{writes['plain'] / writes['kdcache']:.2f}× | ≥ 0.9× |",
        f"| {label} | read, every array | {mb(decoded, reads['kdcache']):,.0f} | {mb(decoded, reads['plain']):,.0f} | "
        f"{reads['plain'] / reads['kdcache']:.2f}× | ≥ 0.9× |",
        f"| {label} | read, every array, 1 decode thread | {mb(decoded, reads['kdcache, 1 thread']):,.0f} | "
        f"{mb(decoded, reads['plain']):,.0f} | {reads['plain'] / reads['kdcache, 1 thread']:.2f}× | ≥ 0.9× |",
        f"| {label} | read top-k, out of {hidden + 1} targets vs alone | {mb(topk_bytes, one['of five']):,.0f} | "
        f"{mb(topk_bytes, one['alone']):,.0f} (alone) | cost {one['of five'] / one['alone']:.2f}× | ≤ 1.2× |",
    ]


def stream_wait(cache: str, steps: int, step_s: float, batch_size: int = 16) -> float:
    """Mean seconds a training step waits for its batch, with ``step_s`` of simulated compute per step; the
    first two steps (the stream's start-up, paid once per run) are left out."""
    from kdcache.stages.train.feed.streaming import CacheStream

    names = [n for n in CacheReader(cache).spec.sequence_names() if n.startswith(("input_ids", "hidden/", "logits/"))]
    stream = iter(CacheStream(cache, names, batch_size=batch_size, seed=0, prefetch=4))
    waits = []
    for _ in range(steps):
        asked = time.perf_counter()
        next(stream)
        waits.append(time.perf_counter() - asked)
        time.sleep(step_s)  # the model's step, during which the stream reads ahead
    return sum(waits[2:]) / len(waits[2:])


def bench_remote(label: str, local: Path, repeats: int, step_s: float = 0.05) -> list[str]:
    """The same cache read from a local S3-compatible server (moto, through s3fs) against the local folder."""
    from tests.helpers.s3_server import make_bucket, serve

    rows = []
    for _ in serve():
        import s3fs

        url = f"{make_bucket('bench-io')}/cache"
        s3fs.S3FileSystem(skip_instance_cache=True).put(str(local), url.removeprefix("s3://"), recursive=True)
        decoded = sum(r.decoded_bytes for r in CacheReader(local).records)
        reads = best(repeats, {"local": lambda: kdcache_read(local, None), "s3": lambda url=url: kdcache_read(url, None)})
        waits = best(max(1, repeats // 2), {"local": lambda: stream_wait(str(local), 40, step_s),
                                            "s3": lambda url=url: stream_wait(url, 40, step_s)})
        rows.append(f"| {label} | read, every array, from a local S3 server (moto) | "
                    f"{decoded / reads['s3'] / 1e6:,.0f} | {decoded / reads['local'] / 1e6:,.0f} (local folder) | "
                    f"{reads['local'] / reads['s3']:.2f}× | – |")
        rows.append(f"| {label} | training stream, data wait per {step_s * 1e3:.0f} ms step | "
                    f"{waits['s3'] * 1e3:.2f} ms (S3) | {waits['local'] * 1e3:.2f} ms (local folder) | – | – |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--llama-shards", type=int, default=3, help="2,048-token shards of the synthetic shape")
    parser.add_argument("--no-s3", action="store_true", help="skip the rows read from a local S3 server")
    parser.add_argument("--no-fsync", action="store_true", help="plain zarr's write without fsync (the old baseline)")
    parser.add_argument("--skip-llama", action="store_true", help="only the MiniLM shape")
    args = parser.parse_args()
    rows = ["| shape | what | kdcache MB/s | plain zarr MB/s | kdcache / plain | target |",
            "| --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        seqs, vocab = minilm_sequences(args.sentences)
        rows += bench_shape("MiniLM, 4 hidden + top-64", seqs, vocab, 128, 4, Path(tmp), args.repeats,
                            not args.no_fsync)
        print("\n".join(rows), flush=True)
        if not args.no_s3:
            rows += bench_remote("MiniLM, 4 hidden + top-64", Path(tmp) / "kd", args.repeats)
        if not args.skip_llama:
            llama = llama_sequences(2048 * args.llama_shards, 256, 4)
            rows += bench_shape("d=4096, 2,048-token shards, 4 hidden + top-64", llama, V_LLAMA, 8, 4, Path(tmp),
                                args.repeats, not args.no_fsync)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
