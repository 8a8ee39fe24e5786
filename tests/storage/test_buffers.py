"""The writer's reused buffers (storage/buffers.py): concatenation equal to numpy's, buffers handed back and
reused, never two leases on one buffer, memory bounded by the most leased at once."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kdcache.storage.buffers import MIN_BYTES, BufferPool


def _parts(rows: list[int], width: int = 1024, dtype: type = np.float16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, width)).astype(dtype) for n in rows]


def test_a_lease_concatenates_as_numpy_does_and_reuses_its_buffers() -> None:
    pool = BufferPool()
    parts = _parts([300, 500, 224])  # 2 MiB of fp16: pooled
    with pool.lease() as lease:
        joined = lease.concatenate(parts)
        np.testing.assert_array_equal(joined, np.concatenate(parts))
        assert joined.dtype == np.float16 and joined.shape == (1024, 1024)
        first = joined.base if joined.base is not None else joined
    assert pool.free_bytes >= joined.nbytes  # handed back when the lease ended
    with pool.lease() as lease:
        again = lease.concatenate(_parts([1024], seed=1))
        assert np.shares_memory(again, first)  # the same memory, not a new allocation
        np.testing.assert_array_equal(again, _parts([1024], seed=1)[0])


def test_small_arrays_and_mixed_dtypes_take_numpy_s_road() -> None:
    pool = BufferPool()
    with pool.lease() as lease:
        small = lease.concatenate([np.arange(3), np.arange(4)])
        mixed = lease.concatenate([np.ones((MIN_BYTES, 1), np.int8), np.ones((1, 1), np.float32)])
    assert small.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert mixed.dtype == np.float32 and mixed.shape == (MIN_BYTES + 1, 1)  # promoted as numpy promotes
    with pytest.raises(ValueError):
        BufferPool().lease().__enter__().concatenate([])


def test_leases_held_at_once_never_share_a_buffer() -> None:
    pool, held, errors = BufferPool(), [], []
    barrier = threading.Barrier(4)

    def work(seed: int) -> None:
        try:
            for round_ in range(5):
                with pool.lease() as lease:
                    parts = _parts([512, 512], seed=seed * 10 + round_)
                    joined = lease.concatenate(parts)
                    held.append(joined)
                    barrier.wait(timeout=30)  # all four leased at once
                    np.testing.assert_array_equal(joined, np.concatenate(parts))  # nobody wrote over it
                    barrier.wait(timeout=30)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert pool.free_bytes <= 4 * 2 * MIN_BYTES  # four buffers of 2 MiB: what was leased at once, no more


def test_free_buffers_beyond_the_most_leased_at_once_are_let_go() -> None:
    pool = BufferPool()
    for rows in (1024, 2048, 4096):  # growing shards: each needs a bigger buffer than the free ones
        with pool.lease() as lease:
            lease.concatenate(_parts([rows]))
    assert pool.free_bytes <= 4096 * 1024 * 2  # the largest lease, not the sum of all three
