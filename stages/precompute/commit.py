"""The writer's side of stage one: open this part's cache writer, and commit shards behind the teacher.

Both teacher adapters (decoder-only or encoder teachers, and encoder-decoder teachers) hand their shards to
``commit_behind``, so resumption, the bounded write queue and the run statistics are the same for every teacher.

Background threads (``BackgroundWriter``) encode, compress and commit shards while the next forward pass runs.
The queue is bounded, so host memory stays flat: when the disk or the compressor is slower than the teacher, the
forward loop waits in ``submit`` instead of piling up shards. At most ``queue_size + workers`` shards wait or are
being written at once, beside the one being computed. Several workers write different shards at the same time:
the checks, the copies into the shard's flat arrays, compression (blosc, zstd) and file I/O release the GIL for
most of their time, so they spread over the host's cores. Shards may commit out of order; each one's sidecar is
its own commit point, and the manifest is folded from them at the end.

An error in a worker (disk full, a fp16 overflow caught by the writer) is re-raised in the main thread at the
next ``submit`` or at ``close``, never swallowed; once one is seen, no further shard is written.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.progress import Progress, RunStats
from kdcache.stages.precompute.rows.batching import Partition
from kdcache.stages.precompute.writer_processes import ProcessWriter
from kdcache.storage import CACHE_ENTRIES, CacheWriter, KdcacheError, ShardRecord, Store, open_store

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec

_STOP = object()


class BackgroundWriter:
    """Runs ``write(index, sequences) -> record`` on ``workers`` threads, taking shards in submission order, then
    hands back the reused buffers the shard's arrays are views of (``ShardItems.release``), also when the commit
    failed: nothing reads them after the write.

    Args:
        write: commits one shard (``CacheWriter.write_shard``); returns its record.
        queue_size: shards that may wait for a worker.
        on_written: called with ``(index, record, seconds)`` after each commit, one call at a time.
        workers: threads writing shards side by side.
    """

    def __init__(self, write: Callable[[int, list], Any], queue_size: int = 2,
                 on_written: Callable[[int, Any, float], None] | None = None, workers: int = 1) -> None:
        self._write, self._on_written = write, on_written
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None  # sticky: once set, nothing more is written
        self._reported = False
        self._lock = threading.Lock()  # guards the first error and on_written's callers
        self._threads = [threading.Thread(target=self._loop, name=f"kdcache-shard-writer-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if self._error is not None:  # after a failure, drain without writing so submit never blocks
                continue
            index, sequences = item
            started = time.perf_counter()
            try:
                record = self._write(index, sequences)
                seconds = time.perf_counter() - started
                with self._lock:
                    if self._on_written is not None:
                        self._on_written(index, record, seconds)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                with self._lock:
                    self._error = self._error or exc
            finally:
                if hasattr(sequences, "release"):
                    sequences.release()

    def _raise_pending(self) -> None:
        if self._error is not None and not self._reported:
            self._reported = True  # raise once; a close() in a finally block must not mask it
            raise self._error

    def submit(self, index: int, sequences: list) -> None:
        """Queue shard ``index``; blocks while the queue is full. Raises an earlier shard's error."""
        self._raise_pending()
        self._queue.put((index, sequences))

    def close(self) -> None:
        """Wait for every queued shard to be committed; re-raise the first error."""
        alive = [thread for thread in self._threads if thread.is_alive()]
        for _ in alive:
            self._queue.put(_STOP)
        for thread in alive:
            thread.join()
        self._raise_pending()


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


def commit_behind(spec: CacheSpec, todo: list[int], writer: CacheWriter, stats: RunStats,
                  stream: Callable[[list[tuple[int, int]], Progress], Shards], *,
                  show_progress: bool, queue_size: int, workers: int = 0, processes: bool = False,
                  label: str = "precompute") -> None:
    """Compute every shard in ``todo`` (``stream(shard_ranges, progress)`` yields them in order); a background
    writer commits each while the next ones are computed.

    Args:
        show_progress: draw the progress bar (``--progress`` on rank 0).
        queue_size: computed shards that may wait for the writer (``--queue-size``).
        workers: threads writing shards side by side (``--writers``; 0: half the host's cores, up to 8).
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
    # --writers 0: half the host's cores (the rest feed the device and tokenize), at least one, at most eight
    # (beyond that a local disk, not the host, sets the pace)
    workers = workers or max(1, min(8, (os.cpu_count() or 2) // 2))
    background: BackgroundWriter | ProcessWriter
    if processes:
        background = ProcessWriter(writer.store.url, writer.spec, queue_size, written, workers)
    else:
        def write(k: int, items: list[dict[str, np.ndarray]]) -> ShardRecord:
            return writer.write_shard(k, items, finite=getattr(items, "finite", frozenset()))

        background = BackgroundWriter(write, queue_size, on_written=written, workers=workers)
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
