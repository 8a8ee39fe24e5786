"""The array layer every hidden codec is written against: the array API standard, through ``array-api-compat``,
plus the four operations the standard lacks, registered once per array library.

A codec's encode and decode are one definition: they take the namespace ``xp`` of their input
(``namespace(x)``) and call only its standard functions and ``ops_for(xp)``. Storage runs them on numpy
(the writer given floats, ``verify``, plain reads); stage one and stage two pass torch tensors on their device
through the same functions. Storage never imports torch: numpy's operations are registered here, torch's by
``stages.targets.hidden.device_codecs`` (``register_ops``), and a test runs every codec on both and requires the
same bytes.

The standard lacks: selecting each row's m largest entries, adding values at per-row indices, and float8 e4m3fn
(neither numpy nor the standard has that dtype; torch casts to it natively).

The seeded orthogonal rotation the quantised codecs apply before rounding is built here too: real LLM activations
have a few channels 100-1000x larger than the rest; a random-sign block-Hadamard rotation spreads each across its
block, so one scale per row no longer flattens the small channels. Rotation = ``hadamard(x * signs)``: signs ``[d]``
from a seed, blocks of ``block_size(d)``; orthonormal and its own inverse (up to the signs), so decoding is
``hadamard(y) * signs``. Its matrices and signs are numpy, made once and copied to each library and device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol, TypeAlias

import numpy as np
from array_api_compat import array_namespace, device as device_of

from kdcache.storage.core.registry import Registry

# An array of whichever library the caller uses (numpy ndarray on the host, torch Tensor on a device). The standard
# has no static type, and a Protocol of the operators the codecs use fails mypy --strict here: each library types
# its operators' results its own way (no-any-return), and NumpyOps' ndarray parameters cannot implement one.
Array: TypeAlias = Any
FP8_MAX = 448.0  # largest finite float8 e4m3fn

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


class ArrayOps(Protocol):
    """What one array library adds to the standard for the codecs (arrays ``[N, d]``, one row per token)."""

    def top_ids(self, a: Array, m: int) -> Array:
        """Column indices ``[N, m]`` int64 of each row's m largest entries, in increasing column order."""

    def add_at_rows(self, y: Array, ids: Array, values: Array) -> Array:
        """``y [N, d]`` with ``values [N, m]`` added at columns ``ids [N, m]`` (distinct within a row)."""

    def fp8_bits(self, v: Array) -> Array:
        """uint8 e4m3fn bit patterns of float32 values within +-448, rounded to nearest, ties to even; -0.0 keeps
        its sign bit (as a float8 cast does)."""

    def fp8_values(self, codes: Array) -> Array:
        """float32 values of uint8 e4m3fn bit patterns."""

    def id_dtype(self) -> object:
        """The dtype of stored outlier ids (uint16 on the host; int16 where the library lacks uint16 kernels)."""

    def sum_dtype(self, like: Array) -> object:
        """The dtype ``row_errors`` sums in beside ``like``: float64, or float32 on a device that has no float64
        (Apple's MPS)."""


_OPS: Registry[ArrayOps] = Registry("array library", TypeError)
NUMPY_COMPAT = "array_api_compat.numpy"  # array_namespace(a numpy array).__name__: array-api-compat's numpy wrapper


def register_ops(namespace: str, ops: ArrayOps) -> None:
    """Make ``ops`` the added operations of the array library whose compat namespace is named ``namespace``
    (``array_namespace(x).__name__``, e.g. ``"array_api_compat.torch"``)."""
    _OPS.add(namespace, ops)


def ops_for(xp: ModuleType) -> ArrayOps:
    """The added operations of namespace ``xp``.

    Raises:
        TypeError: no library registered them (torch's come with ``kdcache.stages.targets.hidden.device_codecs``).
    """
    try:
        return _OPS.lookup(xp.__name__)
    except TypeError as exc:
        raise TypeError(f"hidden codecs: {exc} (torch's operations are registered by importing "
                        "kdcache.stages.targets.hidden.device_codecs)") from None


def namespace(*arrays: Array) -> ModuleType:
    """The array API namespace of ``arrays`` (all of one library): numpy itself where it implements the standard
    (2.1 on), else array-api-compat's wrapper of the library."""
    return _native(array_namespace(*arrays))


@functools.cache
def _native(xp: ModuleType) -> ModuleType:
    # numpy >= 2.1 is an array API namespace of its own, and the compat wrapper's clip writes through boolean
    # masks (several times slower on a [32768, 2048] layer); torch needs the wrapper.
    return np if xp.__name__ == NUMPY_COMPAT and hasattr(np, "astype") else xp


@functools.lru_cache(maxsize=64)
def _constant(xp: ModuleType, device: object, build: Callable[..., np.ndarray], args: tuple[int, ...]) -> Array:
    # Built (log2 b block doublings, a generator) and copied to each device once: the writer, verify and stage one
    # rotate every coded array of every shard, and a host-to-device copy per call would cost a transfer each time.
    return xp.asarray(build(*args), device=device)


def constant(like: Array, build: Callable[..., np.ndarray], *args: int) -> Array:
    """The numpy array ``build(*args)`` in the library and on the device of ``like`` (cached)."""
    return _constant(namespace(like), device_of(like), build, args)


def hadamard(x: Array) -> Array:
    """Orthonormal Hadamard transform of ``x [N, d]`` float32 in blocks of ``block_size(d)`` (its own inverse):
    one dense ``[b, b]`` matmul per block, which a GPU runs on its matrix units."""
    xp, (n, d) = namespace(x), x.shape
    b = block_size(d)
    return xp.reshape(xp.reshape(x, (n, d // b, b)) @ constant(x, hadamard_matrix, b), (n, d))


def integer_hadamard(x: Array) -> tuple[Array, float]:
    """``(x [N, d]`` times the blocks' +1/-1 matrix, ``1 / sqrt(b))``: ``hadamard(x)`` is their product. For integer
    codes the matmul is exact in float32, so that every library's matmul gives the same bits."""
    xp, (n, d) = namespace(x), x.shape
    b = block_size(d)
    summed = xp.reshape(xp.reshape(x, (n, d // b, b)) @ constant(x, sylvester_matrix, b), (n, d))
    return summed, float(np.float32(1.0 / np.sqrt(b)))


def signs(like: Array, seed: int, d: int) -> Array:
    """The rotation's random signs ``[d]`` float32 (``rotation_signs``) beside ``like``."""
    return constant(like, rotation_signs, seed, d)


def row_errors(x: Array, decoded: Array) -> Array:
    """Per row of ``x`` and its decode ``[N, d]`` float32: squared error, squared norm, cosine (1 for two zero
    rows), max |error| and the decoded row's squared norm (which ``verify`` recomputes from the codes) -> ``[N, 5]``
    float32 (``ERROR_FIELDS``).

    Each product is a float32 operation, rounded element by element alike by every library; the sums over a row
    are accumulated in float64 (``ArrayOps.sum_dtype``) and rounded to float32 once. Summed in float32 they
    rounded in each library's own order (numpy's pairwise blocks, torch's vector lanes, whose width depends on
    the CPU), so the record stored by the writer and by stage one differed in its last bits.
    """
    xp = namespace(x, decoded)
    wide = ops_for(xp).sum_dtype(x)
    err = decoded - x
    ref_sq, decoded_sq = _row_sum(xp, x * x, wide), _row_sum(xp, decoded * decoded, wide)  # the norms reuse them
    dot, norms = _row_sum(xp, x * decoded, wide), xp.sqrt(ref_sq * decoded_sq)
    positive = norms > 0
    cosine = xp.where(positive, dot / xp.where(positive, norms, xp.ones_like(norms)), xp.ones_like(norms))
    max_abs = xp.astype(xp.max(xp.abs(err), axis=1), wide)
    columns = [_row_sum(xp, err * err, wide), ref_sq, cosine, max_abs, decoded_sq]
    return xp.astype(xp.stack(columns, axis=1), xp.float32)


def _row_sum(xp: ModuleType, a: Array, dtype: object) -> Array:
    """Each row's sum of ``a [N, d]``, accumulated in ``dtype``."""
    return xp.sum(a, axis=1, dtype=dtype)


def scale_up(scale: Array) -> Array:
    """float32 scales -> float16, rounded towards +inf (never below the float32 value, so that no scaled value
    passes the codec's largest code)."""
    xp = namespace(scale)
    half = xp.astype(scale, xp.float16)
    up = xp.nextafter(half, xp.full_like(half, float("inf")))
    return xp.where(xp.astype(half, xp.float32) < scale, up, half)


class NumpyOps:
    """numpy's added operations (the host: the writer given floats, ``verify``, plain reads)."""

    def top_ids(self, a: np.ndarray, m: int) -> np.ndarray:
        ids: np.ndarray = np.sort(np.argpartition(-a, m - 1, axis=1)[:, :m], axis=1)
        return ids

    def add_at_rows(self, y: np.ndarray, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        out: np.ndarray = y.copy()
        out[np.arange(len(y))[:, None], ids.astype(np.intp)] += values
        return out

    def fp8_bits(self, v: np.ndarray) -> np.ndarray:
        table = fp8_table()[:127]  # the non-negative finite patterns 0x00..0x7E, increasing
        mag = np.minimum(np.abs(v), FP8_MAX)
        upper = np.clip(np.searchsorted(table, mag), 1, 126)
        below, above = mag - table[upper - 1], table[upper] - mag  # exact: neighbours within a factor of two
        down = (below < above) | ((below == above) & (upper & 1).astype(bool))  # a tie goes to the even mantissa
        codes: np.ndarray = (upper - down).astype(np.uint8) | (np.signbit(v).view(np.uint8) << 7)
        return codes

    def fp8_values(self, codes: np.ndarray) -> np.ndarray:
        values: np.ndarray = fp8_table()[codes.astype(np.intp)]
        return values

    def id_dtype(self) -> object:
        return np.uint16

    def sum_dtype(self, like: np.ndarray) -> object:
        return np.float64


@functools.lru_cache(maxsize=1)
def fp8_table() -> np.ndarray:
    """The float32 value of every e4m3fn bit pattern ``[256]`` (0x7F and 0xFF are NaN and never written); one
    shared read-only table."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 15, (bits & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(bits >> 7, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    table = values.astype(np.float32)
    table.flags.writeable = False
    return table


# By its name, not array_namespace(np.empty(0)): that loads array-api-compat's numpy wrapper (a third of a second,
# numpy.f2py with it) at every `kdcache --help`; a numpy array's namespace first loads it when a codec runs.
register_ops(NUMPY_COMPAT, NumpyOps())
register_ops(np.__name__, NumpyOps())  # numpy as its own namespace (``namespace``)
