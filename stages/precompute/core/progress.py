"""Progress bar and end-of-run summary of stage one.

The bar (rank 0 only) counts sequences and shows tokens/s and compressed bytes written. The summary reports,
per target, the bytes each token costs on disk: the figure that decides which layers a sweep can afford.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from kdcache.storage import ArrayKind, format_bytes

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec, Manifest, ShardRecord


@dataclass
class RunStats:
    """Counters of one process's run; the writer thread adds bytes, the main thread everything else."""

    started: float = field(default_factory=time.perf_counter)
    compute_started: float = 0.0  # when the first shard began (after data and model loading)
    compute_seconds: float = 0.0  # first forward to last commit
    tokens: int = 0
    sequences: int = 0
    shards_written: int = 0
    stored_bytes: int = 0
    forward_seconds: float = 0.0
    wait_seconds: float = 0.0  # main thread blocked on a full writer queue
    take_seconds: float = 0.0  # the helper thread's host work taking batches in, after each copy landed
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_shard(self, record: ShardRecord) -> None:
        with self.lock:
            self.shards_written += 1
            self.stored_bytes += int(record.stored_bytes)


LINE_EVERY = 30.0  # seconds between progress lines in a log (stderr not a terminal)


class Progress:
    """A tqdm bar over sequences on a terminal; in a log, a ``kdcache precompute:`` line (``label``: the command)
    every ``LINE_EVERY`` seconds and at the end (a bar's carriage returns make a log file unreadable), with tokens/s
    and the time left at the rate so far; nothing on other ranks or with ``--no-progress``."""

    def __init__(self, total: int, enabled: bool, stats: RunStats, label: str = "precompute") -> None:
        self.stats, self.total, self.done, self.label = stats, total, 0, label
        self.bar = None
        self.lines = enabled and bool(total) and not sys.stderr.isatty() and not os.environ.get("KDCACHE_QUIET")
        self._last_line = time.perf_counter()
        if enabled and total and not self.lines:
            self.bar = tqdm(total=total, unit="seq", desc=label, dynamic_ncols=True)  # its own ETA

    def update(self, sequences: int) -> None:
        self.done += sequences
        # the log's last line comes from close(), once the writer has committed every shard's bytes
        if self.lines and (now := time.perf_counter()) - self._last_line >= LINE_EVERY:
            self._last_line = now
            self._print_line(now)
        if self.bar is not None:
            self._postfix()
            self.bar.update(sequences)

    def _print_line(self, now: float) -> None:
        elapsed = max(now - self.stats.compute_started, 1e-9)
        rate = self.stats.tokens / elapsed
        left = elapsed / self.done * (self.total - self.done) if self.done else None  # sequences go at one pace
        eta = "ETA ?" if left is None else f"ETA {int(left) // 60}:{int(left) % 60:02d}"
        print(f"kdcache {self.label}: {self.done:,}/{self.total:,} sequences | {rate:,.0f} tok/s | {eta} | "
              f"{format_bytes(self.stats.stored_bytes)} written", file=sys.stderr, flush=True)

    def _postfix(self) -> None:
        assert self.bar is not None
        elapsed = max(time.perf_counter() - self.stats.compute_started, 1e-9)
        self.bar.set_postfix(tok_s=f"{self.stats.tokens / elapsed:,.0f}",
                             written=format_bytes(self.stats.stored_bytes), refresh=False)

    def close(self) -> None:
        """Close the bar, or print the log's last line, showing the bytes of every shard committed (call it after
        the writer's last commit)."""
        if self.lines:
            self._print_line(time.perf_counter())
        if self.bar is not None:
            self._postfix()
            self.bar.close()


# What locates and masks the tokens: ids, token arrays and offsets (and their encoder/, decoder/ forms).
INDEX_KINDS = frozenset({ArrayKind.INPUT_IDS, ArrayKind.LOSS_MASK, ArrayKind.POSITION_IDS, ArrayKind.OFFSETS,
                         ArrayKind.ATTENTION_OFFSETS, ArrayKind.CROSS_ATTENTION_OFFSETS})


def target_of(array: str, spec: CacheSpec) -> str:
    """Group arrays into targets: hidden/3, attention/2, ``logits/{mode}`` (every array of the cache's logit
    layout: values+ids+lse for topk), index (what locates and masks the tokens).

    Encoder-decoder names (``encoder/hidden/3``, ``cross_attention/2``) are targets of their own too.
    """
    described = spec.array(array)
    if described.kind in INDEX_KINDS:
        return "index"
    if spec.logit_layout is not None and described.logit is not None:
        return f"logits/{spec.logit_layout.name}"
    return array


def per_target(spec: CacheSpec, sizes: dict[str, float], tokens: int) -> dict[str, float]:
    """Bytes per token of every target (``target_of``) from the bytes of each of its arrays, ``sizes``."""
    out: dict[str, float] = {}
    for name, size in sizes.items():
        key = target_of(name, spec)
        out[key] = out.get(key, 0.0) + size / max(tokens, 1)
    return out


def bytes_per_token(manifest: Manifest) -> dict[str, float]:
    """Stored bytes per valid token of every target of the cache (committed shards)."""
    sizes = {name: info["stored_bytes"] for name, info in manifest.arrays.items()}
    return dict(sorted(per_target(manifest.spec, sizes, manifest.num_tokens).items(),
                       key=lambda kv: _target_order(kv[0])))


def _target_order(name: str) -> tuple[int, int, str]:
    kind, _, layer = name.partition("/")
    rank = {"index": 0, "hidden": 1, "attention": 2, "logits": 3}.get(kind, 4)
    return rank, int(layer) if layer.isdigit() else 0, name


def summarize(stats: RunStats, manifest: Manifest, skipped: int, out: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The run's summary: this process's work and the cache's totals."""
    wall, compute = time.perf_counter() - stats.started, stats.compute_seconds
    return {
        "out": str(out), "status": manifest.status,
        "num_sequences": manifest.spec.num_sequences, "num_shards": manifest.spec.num_shards,
        "committed_shards": len(manifest.shards), "shards_written": stats.shards_written,
        "shards_skipped": skipped, "sequences": stats.sequences, "tokens": stats.tokens,
        "bytes_written": stats.stored_bytes, "wall_seconds": round(wall, 3), "compute_seconds": round(compute, 3),
        "tokens_per_second": round(stats.tokens / compute, 1) if compute > 0 else 0.0,
        "forward_seconds": round(stats.forward_seconds, 3), "writer_wait_seconds": round(stats.wait_seconds, 3),
        "take_seconds": round(stats.take_seconds, 3),
        "cache_tokens": manifest.num_tokens, "bytes_per_token": {k: round(v, 2) for k, v in
                                                                 bytes_per_token(manifest).items()},
        **extra,
    }


def reused_cache(summary: dict[str, Any]) -> bool:
    """Whether a run found its cache complete with matching fingerprints and computed nothing: what ``kdcache run``
    and ``kdcache demo`` tell as reusing the cache."""
    return summary.get("status") == "complete" and summary.get("shards_written") == 0


def format_summary(summary: dict[str, Any]) -> str:
    """A few human lines for the end of a CLI run."""
    lines = [
        f"cache {summary['out']}: {summary['status']}, {summary['committed_shards']}/{summary['num_shards']} shards, "
        f"{summary['num_sequences']:,} sequences, {summary['cache_tokens']:,} tokens",
        f"this run: {summary['shards_written']} shard(s) written, {summary['shards_skipped']} already committed, "
        f"{summary['tokens']:,} tokens in {summary['compute_seconds']:.1f} s of compute "
        f"({summary['tokens_per_second']:,.0f} tokens/s; {summary['wall_seconds']:.1f} s with loading), "
        f"{format_bytes(summary['bytes_written'])} written",
        "bytes/token: " + ", ".join(f"{k} {v:,.1f}" for k, v in summary["bytes_per_token"].items()),
    ]
    dropped = summary.get("dropped_rows") or {}
    if any(dropped.values()):
        lines.append(f"rows skipped: {dropped.get('empty', 0):,} blank, {dropped.get('untrained', 0):,} with no "
                     f"trained token within --max-length")
    return "\n".join(lines)
