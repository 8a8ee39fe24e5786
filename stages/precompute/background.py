"""Background threads that encode, compress and commit shards while the next forward pass runs.

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
from collections.abc import Callable
from typing import Any

_STOP = object()


def default_workers() -> int:
    """Writer threads when ``--writers`` is 0: half the host's cores (the rest feed the device and tokenize),
    at least one, at most eight (beyond that a local disk, not the host, sets the pace)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class BackgroundWriter:
    """Runs ``write(index, sequences) -> record`` on ``workers`` threads, taking shards in submission order.

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
