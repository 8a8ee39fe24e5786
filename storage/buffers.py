"""Host buffers a writer reuses for its shards' flat arrays, instead of a fresh allocation per array and shard.

A shard's flat arrays (a hidden layer of 16,384 tokens at d = 2,048 in fp16: 67 MB) are the same sizes shard after
shard. A fresh array of that size is new memory the kernel maps page by page on first touch: on the 2-core box the
concatenation into it took about 180 ms, three times the copy itself, and freeing it again is an ``munmap`` with
the GIL held, stalling the thread that launches the teacher's kernels (benchmarks/RESULTS.md). A pool hands the
same buffers back once the shard they held is committed.

Memory: a buffer is only made when no free one fits, so the pool holds about what the writers held at once; free
buffers beyond the most ever leased at once (the high-water mark) are let go.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np

MIN_BYTES = 1 << 20  # smaller arrays are cheap to allocate: np.concatenate makes them as before


class BufferPool:
    """Free ``uint8`` buffers, best fit first; thread-safe (a writer's threads share one pool)."""

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._leased = 0  # bytes leased now
        self._peak = 0  # the most bytes ever leased at once

    def take(self, nbytes: int) -> np.ndarray:
        """A free buffer of at least ``nbytes`` (the smallest such), or a new one of exactly ``nbytes``."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            buffer = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
            if buffer is None:
                buffer = np.empty(nbytes, dtype=np.uint8)
            self._leased += buffer.nbytes
            self._peak = max(self._peak, self._leased)
            return buffer

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer from ``take``; nothing may still read or write it."""
        with self._lock:
            self._leased -= buffer.nbytes
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._free) > self._peak:  # sizes changed: keep no more than was needed
                self._free.pop(0)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    @contextmanager
    def lease(self) -> Iterator[Lease]:
        """A ``Lease`` whose buffers all come back to the pool when the block ends (also on an error)."""
        lease = Lease(self)
        try:
            yield lease
        finally:
            lease.release()


class Lease:
    """Buffers taken for one shard's arrays, handed back together by ``release`` (``BufferPool.lease`` does so when
    its block ends; stage one's copies out of pinned memory release theirs once their shard is committed)."""

    def __init__(self, pool: BufferPool) -> None:
        self._pool = pool
        self._taken: list[np.ndarray] = []

    def concatenate(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """``np.concatenate(parts)`` (along axis 0), written into a pooled buffer when it is large.

        Args:
            parts: arrays ``[n_i, ...]`` with equal trailing dimensions.

        Returns:
            ``[sum n_i, ...]`` of ``np.result_type(*parts)``; valid until the lease ends.
        """
        if not parts:
            return np.concatenate(parts)  # numpy's own error
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return np.concatenate(parts, out=self.empty(shape, np.result_type(*parts)))

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """``np.empty(shape, dtype)``, in a pooled buffer when it is large; valid until the lease ends."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < MIN_BYTES:
            return np.empty(shape, dtype)
        buffer = self._pool.take(nbytes)
        self._taken.append(buffer)
        return buffer[:nbytes].view(dtype).reshape(shape)

    def release(self) -> None:
        """Give every buffer back (the arrays made from them must no longer be used)."""
        for buffer in self._taken:
            self._pool.give(buffer)
        self._taken = []
