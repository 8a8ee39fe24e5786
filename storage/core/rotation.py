"""The seeded orthogonal rotation the quantised hidden codecs apply before rounding (storage.hidden_codecs).

Real LLM activations have a few channels 100-1000x larger than the rest; a random-sign block-Hadamard rotation
spreads each across its block, so one scale per row no longer flattens the small channels. Rotation =
``hadamard(x * signs)``: signs ``[d]`` from a seed, blocks of ``block_size(d)``; orthonormal and its own inverse
(up to the signs), so decoding is ``hadamard(y) * signs``. Here are the matrices and signs, numpy only; the
transform itself is ``storage.hidden_codecs.arrays.hadamard``, one for numpy and the devices' torch alike.
"""

from __future__ import annotations

import functools

import numpy as np

MAX_BLOCK = 256  # a dense block costs b multiply-adds per value; 256 spreads an outlier far enough


def block_size(d: int) -> int:
    """The rotation's Hadamard block: the largest power of two dividing d, at most ``MAX_BLOCK``."""
    return min(d & -d, MAX_BLOCK)


def hadamard_matrix(b: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix ``[b, b]`` float32 (b a power of two; symmetric, its own
    inverse): ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]] / sqrt(2)``. The caller's own copy."""
    matrix: np.ndarray = _hadamard_matrix(b).copy()
    return matrix


def sylvester_matrix(b: int) -> np.ndarray:
    """``hadamard_matrix(b) * sqrt(b)``: the same matrix of +1/-1, float32, the caller's own copy. Integer codes
    times it sum exactly in float32 (|sum| ≤ 127 · 256 < 2²⁴), whatever order a library's matmul adds them in."""
    matrix: np.ndarray = _sylvester_matrix(b).copy()
    return matrix


def rotation_signs(seed: int, d: int) -> np.ndarray:
    """The rotation's random signs ``[d]`` float32 (+1/-1), from ``numpy.random.default_rng(seed)``. The caller's
    own copy."""
    signs: np.ndarray = _rotation_signs(seed, d).copy()
    return signs


# Built once per size (the writer and verify rotate every coded array of every shard), kept read-only so that no
# caller can change the shared array; a copy costs microseconds, the build (log2 b block doublings, a generator)
# far more, and a copy is writable, as torch.from_numpy wants.
@functools.lru_cache(maxsize=16)
def _sylvester_matrix(b: int) -> np.ndarray:
    h = np.ones((1, 1))
    while len(h) < b:
        h = np.block([[h, h], [h, -h]])
    return _read_only(h.astype(np.float32))


@functools.lru_cache(maxsize=16)
def _hadamard_matrix(b: int) -> np.ndarray:
    return _read_only((_sylvester_matrix(b).astype(np.float64) / np.sqrt(b)).astype(np.float32))


@functools.lru_cache(maxsize=64)
def _rotation_signs(seed: int, d: int) -> np.ndarray:
    return _read_only((np.random.default_rng(seed).integers(0, 2, d) * 2 - 1).astype(np.float32))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
