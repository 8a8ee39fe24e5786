"""Stage two's stream at epoch boundaries: does the step wait for the next epoch's first shards?

A small cache (every sequence in one shuffle block, as a cache of a few shards is) is streamed for three epochs
by ``CacheStream`` into a consumer that spends a fixed time per micro-batch, standing in for a GPU step that does
not need the host. Per micro-batch the time the consumer waited for it is recorded. Reported:

* ``boundary_vs_mid``: the wall time of the ``--window`` steps holding each later epoch boundary (half before,
  half after) against the same number of steps in mid-epoch (1.0: the boundary costs nothing);
* ``boundary_wait_s``: the consumer's wait within those windows, per boundary;
* ``decodes``: shards decoded over the run (``reader.read_shard`` calls), against shards x epochs.

Run on the code that is installed, so the same script measures a tree before and after a change:
``.venv/bin/python benchmarks/bench_epoch_boundary.py [--repeats 3] [--step-ms 25] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kdcache.stages.train.feed.streaming import CacheStream
from kdcache.storage import CacheReader, CacheSpec, CacheWriter


def build_cache(root: Path, shards: int, per_shard: int, tokens: int, width: int) -> Path:
    """A zarr cache of ``shards`` x ``per_shard`` sequences of ``tokens`` tokens, four fp16 hidden layers."""
    layers = (1, 2, 3, 4)
    spec = CacheSpec(num_sequences=shards * per_shard, hidden_layers=layers, sequences_per_shard=per_shard,
                     dtype="fp16", logits=None)
    rng = np.random.default_rng(0)
    layer = rng.standard_normal((per_shard * tokens, width), dtype=np.float32).astype(np.float16)
    with CacheWriter(root, spec, {}) as writer:
        for k in range(shards):
            items = [{"input_ids": rng.integers(0, 1000, tokens),
                      **{f"hidden/{j}": layer[i * tokens:(i + 1) * tokens] for j in layers}}
                     for i in range(per_shard)]
            writer.write_shard(k, items)
        writer.finalize()
    return root


def stream_once(cache: Path, epochs: int, batch: int, step: float) -> dict[str, Any]:
    """Stream ``epochs`` epochs, sleeping ``step`` per micro-batch; each batch's wait and arrival time."""
    reader = CacheReader(cache)
    calls = []
    read_shard = reader.read_shard
    reader.read_shard = lambda index, names=None: calls.append(index) or read_shard(index, names)  # type: ignore[method-assign]
    names = ["input_ids", *(f"hidden/{j}" for j in (1, 2, 3, 4))]
    stream = CacheStream(reader, names, batch_size=batch, seed=0, epochs=epochs, shuffle_block=1 << 20)
    waits, ends, epochs_seen = [], [], []
    batches = iter(stream)
    while True:
        asked = time.perf_counter()
        item = next(batches, None)
        waits.append(time.perf_counter() - asked)
        if item is None:
            waits.pop()
            break
        epochs_seen.append(item["epoch"])
        time.sleep(step)
        ends.append(time.perf_counter())
    return {"waits": waits, "ends": ends, "epochs": epochs_seen, "decodes": len(calls),
            "shards": len(stream.shard_ids), "steps": stream.steps_per_epoch}


def summarise(run: dict[str, Any], window: int) -> dict[str, float]:
    """The boundary windows' wall time against mid-epoch windows of the same length, and their waits."""
    steps, ends, waits = run["steps"], run["ends"], run["waits"]
    if window < 2 or window % 2 or steps < 2 * window:
        raise ValueError(f"window {window}: expected an even number of steps >= 2, at most half an epoch ({steps})")
    half = window // 2
    ratios, boundary_waits = [], []
    for epoch in range(1, max(run["epochs"]) + 1):
        first = epoch * steps
        start, stop = first - half, first + half
        mid = epoch * steps - steps // 2 - half  # the previous epoch's middle
        ratios.append((ends[stop - 1] - ends[start - 1]) / (ends[mid + window - 1] - ends[mid - 1]))
        boundary_waits.append(sum(waits[start:stop]))
    return {"boundary_vs_mid": round(max(ratios), 3), "boundary_wait_s": round(max(boundary_waits), 3),
            "mid_wait_per_step_ms": round(1e3 * statistics.median(waits[steps // 4:steps // 2]), 2),
            "decodes": run["decodes"], "shards_x_epochs": run["shards"] * (max(run["epochs"]) + 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=8, help="sequences per shard")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=1024, help="hidden width (four fp16 layers are cached)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--step-ms", type=float, default=25.0, help="the consumer's time per micro-batch")
    parser.add_argument("--window", type=int, default=8, help="steps around a boundary")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kdcache-epochs-") as tmp:
        cache = build_cache(Path(tmp) / "cache", args.shards, args.per_shard, args.tokens, args.width)
        runs = [summarise(stream_once(cache, 3, args.batch, args.step_ms / 1e3), args.window)
                for _ in range(args.repeats)]
    result = {**min(runs, key=lambda r: r["boundary_vs_mid"]), "runs": runs, "step_ms": args.step_ms}
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
