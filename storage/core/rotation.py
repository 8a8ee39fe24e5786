"""The seeded orthogonal rotation the quantised hidden codecs apply before rounding (storage.hidden_codecs).

Real LLM activations have a few channels 100-1000x larger than the rest; a random-sign block-Hadamard rotation
spreads each across its block, so one scale per row no longer flattens the small channels. Rotation =
``hadamard(x * signs)``: signs ``[d]`` from a seed, blocks of ``block_size(d)``; orthonormal and its own inverse
(up to the signs), so decoding is ``hadamard(y) * signs``. Here are the matrices and signs, numpy only; the
transform itself is ``storage.hidden_codecs.arrays.hadamard``, one for numpy and the devices' torch alike.
"""

from __future__ import annotations

import numpy as np

MAX_BLOCK = 256  # a dense block costs b multiply-adds per value; 256 spreads an outlier far enough


def block_size(d: int) -> int:
    """The rotation's Hadamard block: the largest power of two dividing d, at most ``MAX_BLOCK``."""
    return min(d & -d, MAX_BLOCK)


def sylvester_matrix(b: int) -> np.ndarray:
    """The Sylvester-Hadamard matrix of +1/-1 ``[b, b]`` float32 (b a power of two): ``H_1 = [1]``,
    ``H_2n = [[H_n, H_n], [H_n, -H_n]]``. Integer codes times it sum exactly in float32 (|sum| ≤ 127 · 256 < 2²⁴),
    whatever order a library's matmul adds them in."""
    h = np.ones((1, 1))
    while len(h) < b:
        h = np.block([[h, h], [h, -h]])
    return h.astype(np.float32)


def hadamard_matrix(b: int) -> np.ndarray:
    """``sylvester_matrix(b) / sqrt(b)``: the orthonormal matrix ``[b, b]`` float32 (symmetric, its own inverse)."""
    matrix: np.ndarray = (sylvester_matrix(b).astype(np.float64) / np.sqrt(b)).astype(np.float32)
    return matrix


def rotation_signs(seed: int, d: int) -> np.ndarray:
    """The rotation's random signs ``[d]`` float32 (+1/-1), from ``numpy.random.default_rng(seed)``."""
    return (np.random.default_rng(seed).integers(0, 2, d) * 2 - 1).astype(np.float32)
