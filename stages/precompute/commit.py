"""The writer's side of stage one: open this part's cache writer, and commit shards behind the teacher.

Both teacher adapters (decoder-only or encoder teachers, and encoder-decoder teachers) hand their shards to
``commit_behind``, so resumption, the bounded write queue and the run statistics are the same for every teacher.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.precompute.background import BackgroundWriter, default_workers
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.progress import Progress, RunStats
from kdcache.stages.precompute.rows.batching import Partition
from kdcache.stages.precompute.writer_processes import ProcessWriter
from kdcache.storage import CACHE_ENTRIES, CacheWriter, KdcacheError, ShardRecord, Store, open_store

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec


def open_writer(store: Store, spec: CacheSpec, fingerprints: dict[str, Any], part: Partition) -> CacheWriter:
    """Open (create or resume) this part's writer on the output ``store`` (``check_out_folder``'s).

    Raises:
        PrecomputeError: the folder cannot be written.
        CacheMismatchError / CacheLockedError: from storage (a different cache; a live writer of this part).
    """
    try:
        return CacheWriter(store, spec, fingerprints, part=(part.index, part.count))
    except KdcacheError:
        raise
    except OSError as exc:
        raise PrecomputeError(f"out: cannot write the cache at {store.url!r}: {exc.strerror or exc}") from None


def check_out_folder(out: str) -> Store:
    """The store at ``out``, opened once for the whole run, refused when it holds something other than a
    (partial) cache: checked before anything, rows included, is written there.

    Raises:
        PrecomputeError: a non-empty folder or prefix without a manifest and with entries no cache has.
    """
    store = open_store(out)
    foreign = sorted(name for name in store.list("") if name not in CACHE_ENTRIES and not name.startswith("."))
    if foreign and store.size("manifest.json") is None:
        raise PrecomputeError(f"out: {out!r} is not empty and holds no kdcache cache (found "
                              f"{', '.join(foreign[:5])}); choose a new or empty folder or prefix")
    return store


Shards = Generator[list[dict[str, np.ndarray]], None, None]  # per shard, its sequences' arrays, in order


def write_then_release(writer: CacheWriter) -> Callable[[int, list[dict[str, np.ndarray]]], ShardRecord]:
    """``write(index, items) -> record``: commit the shard, then hand back the reused buffers its arrays are views
    of (``ShardItems.release``), also when the commit failed: nothing reads them after the write."""

    def write(index: int, items: list[dict[str, np.ndarray]]) -> ShardRecord:
        try:
            return writer.write_shard(index, items, finite=getattr(items, "finite", frozenset()))
        finally:
            if hasattr(items, "release"):
                items.release()
    return write


def commit_behind(spec: CacheSpec, todo: list[int], writer: CacheWriter, stats: RunStats,
                  stream: Callable[[list[tuple[int, int]], Progress], Shards], *,
                  show_progress: bool, queue_size: int, workers: int = 0, processes: bool = False,
                  label: str = "precompute") -> None:
    """Compute every shard in ``todo`` (``stream(shard_ranges, progress)`` yields them in order); a background
    writer commits each while the next ones are computed.

    Args:
        show_progress: draw the progress bar (``--progress`` on rank 0).
        queue_size: computed shards that may wait for the writer (``--queue-size``).
        workers: threads writing shards side by side (``--writers``; 0: ``background.default_workers``).
        processes: write in worker processes instead (``--writer-processes``, ``writer_processes``).
        label: the command the progress names (``kdcache generate`` passes ``generate``).
    """
    total = sum(spec.shard_range(k)[1] - spec.shard_range(k)[0] for k in todo)
    stats.compute_started = time.perf_counter()
    progress = Progress(total, show_progress, stats, label)

    def written(index: int, record: ShardRecord, seconds: float) -> None:
        stats.add_shard(record)
        if processes:  # the part's lease is this process's to renew
            writer.renew()

    # the shards' writer: threads of this process, or worker processes fed through shared memory
    workers = workers or default_workers()
    background: BackgroundWriter | ProcessWriter
    if processes:
        background = ProcessWriter(writer.store.url, writer.spec, queue_size, written, workers)
    else:
        background = BackgroundWriter(write_then_release(writer), queue_size, on_written=written, workers=workers)
    shards = stream([spec.shard_range(k) for k in todo], progress)
    try:
        for k, items in zip(todo, shards, strict=True):
            waited = time.perf_counter()
            background.submit(k, items)
            stats.wait_seconds += time.perf_counter() - waited
    finally:
        shards.close()  # an error in the writers: the teacher's pipeline stops before close() waits for them
        background.close()
        progress.close()
        stats.compute_seconds = time.perf_counter() - stats.compute_started
