"""A background thread that encodes, compresses and commits shards while the next forward pass runs.

The queue is bounded, so host memory stays flat: when the disk or the compressor is slower than the teacher, the
forward loop waits in ``submit`` instead of piling up shards. Compression (blosc, zstd) and file I/O release the
GIL, so this overlaps with the forward on its own core.

An error in the thread (disk full, a fp16 overflow caught by the writer) is re-raised in the main thread at the
next ``submit`` or at ``close``, never swallowed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_STOP = object()


class BackgroundWriter:
    """Runs ``write(index, sequences) -> record`` on a worker thread, in submission order.

    Args:
        write: commits one shard (``CacheWriter.write_shard``); returns its record.
        queue_size: shards that may wait for the thread.
        on_written: called on the worker thread with ``(index, record, seconds)`` after each commit.
    """

    def __init__(self, write: Callable[[int, list], Any], queue_size: int = 2,
                 on_written: Callable[[int, Any, float], None] | None = None) -> None:
        self._write, self._on_written = write, on_written
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None  # sticky: once set, nothing more is written
        self._reported = False
        self.busy_seconds = 0.0
        self._thread = threading.Thread(target=self._loop, name="kdcache-shard-writer", daemon=True)
        self._thread.start()

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
                self.busy_seconds += seconds
                if self._on_written is not None:
                    self._on_written(index, record, seconds)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self._error = exc

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
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._raise_pending()
