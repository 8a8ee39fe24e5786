"""The cache's size before the run: ``--estimate`` and the up-front refusal of a destination that cannot hold it.

Two figures, for two moments:

* Before the teacher loads, ``lower_bound_bytes`` sizes what the spec alone fixes: hidden states
  (``layers x tokens x d``), attention maps (``layers x heads x sum L_i^2``, halved for the triangle) and every
  array of the logit layout (``tokens x`` its width), at their storage dtype and uncompressed. Attention kept as
  token rows (an attention source such as ``qk``/``qkv``) counts what the source says, ``tokens x (H + H_kv) x
  head_dim`` per block (plus ``H_kv x head_dim`` for the values), whatever the lengths, since the spec sized before
  the teacher loads still names maps. A real run refuses a
  local destination whose free space is below a quarter of that (``check_room``): lossless codecs shrink fp16
  activations by ~1.1x, so a destination that could not hold the cache even at 4x is clearly too small, and the
  refusal costs seconds rather than hours of teacher time.
* ``--estimate`` runs the real teacher over the first shards (at least ``SAMPLE_ROWS`` rows), writes them with
  the real codecs into a scratch cache, and scales each array's bytes to the whole data: attention by the sum of
  squared lengths, everything else by tokens. The time follows from the sample's rate, timed over ``TIMED_PASSES``
  runs of it after one untimed run that writes it (the median, with the fastest and slowest as a range: one
  timing on a shared machine is a draw).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.progress import per_target
from kdcache.stages.targets import attention as attention_sources
from kdcache.storage import ArrayKind, CacheWriter, format_bytes, is_url

if TYPE_CHECKING:
    import numpy as np
    from transformers import PretrainedConfig

    from kdcache.stages.precompute.rows.data import TokenStreams
    from kdcache.storage import CacheSpec, ShardRecord

SAMPLE_ROWS = 64  # rows the estimate runs the teacher on (whole shards, so per-shard overheads are counted)
TIMED_PASSES = 3  # times the sample is run: the median pass gives the time, the fastest and slowest its range
CLEAR_MARGIN = 4  # refuse only when even this compression ratio would not make the cache fit


def free_bytes(out: str) -> int | None:
    """Free bytes where a local cache folder ``out`` goes (its nearest existing folder); None for a URL."""
    if is_url(out) and not out.startswith("file://"):
        return None
    path = Path(out.removeprefix("file://")).expanduser().absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def lower_bound_bytes(spec: CacheSpec, config: PretrainedConfig, data: TokenStreams,
                      source: attention_sources.AttentionSource | None = None) -> int:
    """Uncompressed bytes of the cache's hidden states, attention (maps, or per ``source`` queries/keys/values)
    and the logit layout's arrays (see the module docstring); what depends on the teacher's outputs (documents'
    attention blocks) counts 0. ``source``: the run's attention source (None: the one the spec names), whose
    rows the spec sized before the teacher loads still names as maps."""
    source = attention_sources.of(spec.attention_layout) if source is None else source
    d = int(getattr(config, "hidden_size", None) or getattr(config, "d_model", None) or 0)
    tokens, sum_sq = data.meta.get("tokens", {}), data.meta.get("sum_sq_lengths", {})
    total = 0
    for described in spec.arrays():
        name, kind, stream, item = described.name, described.kind, described.stream, described.dtype.itemsize
        if kind == ArrayKind.HIDDEN:
            total += tokens.get(stream, 0) * d * item
        elif kind == ArrayKind.ATTENTION:
            total += source.estimate_bytes(spec, name, config, tokens.get(stream, 0), sum_sq.get(stream, 0), item)
        elif (array := described.logit) is not None:  # [T, width] of its layout's spec field, or [T]
            total += tokens.get(stream, 0) * (int(getattr(spec, array.width)) if array.width else 1) * item
    return total


def check_room(out: str, needed: int) -> None:
    """Refuse a local destination that clearly cannot hold ``needed`` bytes (a lower bound of the cache),
    counting the shards a resumed run already has there.

    Raises:
        PrecomputeError: free space below ``needed / CLEAR_MARGIN``, naming both.
    """
    free = free_bytes(out)
    if free is None:
        return
    shards = Path(out.removeprefix("file://")).expanduser() / "shards"
    written = sum(p.stat().st_size for p in shards.rglob("*") if p.is_file()) if shards.is_dir() else 0
    remaining = max(0, needed - written * CLEAR_MARGIN)
    if free * CLEAR_MARGIN < remaining:
        raise PrecomputeError(f"out: the cache needs at least {format_bytes(remaining / CLEAR_MARGIN)} (its targets "
                              f"take {format_bytes(remaining)} before compression), and {out!r} has only "
                              f"{format_bytes(free)} free; free space, choose another --out, or cache fewer "
                              f"targets (run with --estimate for the expected size)")


def sample_shards(spec: CacheSpec) -> list[int]:
    """The first shards, enough to hold ``SAMPLE_ROWS`` rows (all of them for small data)."""
    return list(range(min(spec.num_shards, math.ceil(SAMPLE_ROWS / spec.sequences_per_shard))))


def estimate(spec: CacheSpec, data: TokenStreams, out: str,
             compute: Callable[[tuple[int, int]], list[dict[str, np.ndarray]]],
             fingerprints: dict[str, Any]) -> dict[str, Any]:
    """Run ``compute(bounds)`` (the teacher over a shard's rows) on the sample shards, write them into a scratch
    cache with the real codecs, and scale to the whole data. The sample is run once to be written (untimed: its
    one-off costs are the run's, once) and ``TIMED_PASSES`` times more: one timing on a shared machine is a draw,
    and the spread of several says how far to trust it.

    Returns:
        ``{"status": "estimate", "num_sequences", "tokens", "bytes_per_token" (per target), "total_bytes",
        "seconds" (at the median pass's rate), "seconds_range" (fastest and slowest pass), "sample_rows",
        "sample_rates" (tokens/s of each pass), "sample_tokens_per_second" (their median), "free_bytes", "fits"}``.
    """
    shards = sample_shards(spec)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kdcache-estimate-") as scratch:
        with CacheWriter(scratch, spec, fingerprints, part=(0, 1)) as writer:
            # Round 0 writes the sample and is not timed: it pays the one-off costs (kernels chosen, memory
            # pooled, a --compile-teacher compile) that the run pays once, not per shard.
            records = [writer.write_shard(k, compute(spec.shard_range(k))) for k in shards]
            passes = []
            for _ in range(TIMED_PASSES):
                begun = time.perf_counter()
                for k in shards:
                    compute(spec.shard_range(k))
                passes.append(time.perf_counter() - begun)
    rows = spec.shard_range(shards[-1])[1]
    return _scale(spec, data, out, records, rows, passes, time.perf_counter() - started)


def _scale(spec: CacheSpec, data: TokenStreams, out: str, records: list[ShardRecord], rows: int,
           passes: list[float], wall: float) -> dict[str, Any]:
    """Per-array bytes of the sample shards, scaled by tokens (or squared lengths for attention); the time from
    each timed pass's rate."""
    tokens, sum_sq = data.meta["tokens"], data.meta["sum_sq_lengths"]
    # tokens (False) and summed squared lengths (True) of the sample's rows, per stream
    lengths = {s: data.lengths(s)[:rows] for s in data.streams}
    seen = {False: {s: int(v.sum()) for s, v in lengths.items()},
            True: {s: int((v * v).sum()) for s, v in lengths.items()}}
    per_array: dict[str, float] = {}
    for record in records:
        for name, info in record.arrays.items():
            array = spec.array(name)
            stream, by_sq = array.stream, array.is_map
            scale = (sum_sq if by_sq else tokens)[stream] / max(seen[by_sq][stream], 1)
            per_array[name] = per_array.get(name, 0.0) + info["stored_bytes"] * scale
    shard_bytes = sum(r.stored_bytes - sum(a["stored_bytes"] for a in r.arrays.values()) for r in records)
    total = sum(per_array.values()) + shard_bytes / len(records) * spec.num_shards
    all_tokens = sum(tokens.values())
    free = free_bytes(out)
    return {"status": "estimate", "out": out, "num_sequences": len(data), "tokens": all_tokens,
            "bytes_per_token": {k: round(v, 2) for k, v in per_target(spec, per_array, all_tokens).items()},
            "total_bytes": int(total),
            **_timing(all_tokens, sum(seen[False].values()), passes), "sample_rows": rows,
            "sample_seconds": round(wall, 2), "free_bytes": free, "fits": None if free is None else bool(free >= total)}


def _timing(all_tokens: int, sample_tokens: int, passes: list[float]) -> dict[str, Any]:
    """The whole run's time at the median pass's rate, and at the fastest and the slowest pass's."""
    rates = sorted(sample_tokens / s for s in passes if s > 0)
    median, known = (rates[len(rates) // 2] if rates else 0.0), bool(rates and all_tokens)
    # Three decimals: a small run's fraction of a second is told as such (``0.04 s``), not rounded to nothing.
    return {"seconds": round(all_tokens / median, 3) if known else None,
            "seconds_range": [round(all_tokens / rates[-1], 3), round(all_tokens / rates[0], 3)] if known else None,
            "sample_rates": [round(r, 1) for r in rates], "sample_tokens_per_second": round(median, 1)}


def format_estimate(summary: dict[str, Any]) -> str:
    """A few human lines for ``--estimate`` (only the memory per rank for a teacher without weights)."""
    memory = [summary["memory"]["line"]] if summary.get("memory") else []
    if summary["status"] == "memory":
        return "\n".join([*memory, "the memory per rank only, from the teacher's config (the size and time need "
                                    "its weights, run with the layout's ranks)"])
    room = ("unknown (object store)" if summary["fits"] is None else
            f"{format_bytes(summary['free_bytes'])} free: {'fits' if summary['fits'] else 'DOES NOT FIT'}")
    return "\n".join([
        f"estimate for {summary['out']}: {summary['num_sequences']:,} rows, {summary['tokens']:,} tokens",
        "bytes/token: " + ", ".join(f"{k} {v:,.1f}" for k, v in summary["bytes_per_token"].items()),
        f"total: {format_bytes(summary['total_bytes'])}; time: {_time_words(summary)}",
        f"destination: {room}",
        *memory,
    ])


def _time_words(summary: dict[str, Any]) -> str:
    """``35 s at 1,200 tokens/s, the median of 3 timed passes over 64 rows (18 s to 58 s from the fastest pass to
    the slowest; a busy machine runs slower)``; ``unknown`` without a measured rate."""
    seconds, spread = summary["seconds"], summary.get("seconds_range")
    if seconds is None:
        return "unknown"
    passes = len(summary.get("sample_rates") or [1])
    rate = f"{summary['sample_tokens_per_second']:,.0f} tokens/s"
    if not spread or passes < 2:
        return f"{format_duration(seconds)} at {rate} (measured on {summary['sample_rows']:,} rows)"
    return (f"{format_duration(seconds)} at {rate}, the median of {passes} timed passes over "
            f"{summary['sample_rows']:,} rows ({format_duration(spread[0])} to {format_duration(spread[1])} from "
            "the fastest pass to the slowest; a busy machine runs slower)")


def format_duration(seconds: float) -> str:
    """A time in the unit that reads best: ``42 s``, ``7.5 min``, ``6.90 h`` (never ``0.00 h`` for a short run)."""
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.2f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:,.2f} h"

