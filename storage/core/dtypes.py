"""Value types of float targets: fp16 with an overflow check, bf16 as uint16 bits, and bitround.

Everything here is pure numpy. bf16 has no numpy dtype, so a bf16 target is stored as the upper 16 bits of the
float32 pattern in a ``uint16`` array; :func:`to_float32` turns either storage form back into float32.
"""

from __future__ import annotations

import numpy as np

from kdcache.storage.core.errors import Fp16OverflowError, InvalidSequenceError, NonFiniteValueError, SpecError

# storage dtype name -> (numpy dtype on disk, explicit mantissa bits)
STORAGE_DTYPES: dict[str, tuple[np.dtype, int]] = {
    "fp16": (np.dtype(np.float16), 10),
    "bf16": (np.dtype(np.uint16), 7),
}
FP16_MAX = float(np.finfo(np.float16).max)  # 65504
SMALLEST_NORMAL = {"fp16": float(np.finfo(np.float16).tiny), "bf16": float(np.finfo(np.float32).tiny)}


def storage_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype that holds ``dtype_name`` ("fp16" or "bf16") on disk."""
    if dtype_name not in STORAGE_DTYPES:
        raise SpecError(f"unknown float dtype {dtype_name!r}; expected one of {sorted(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[dtype_name][0]


def check_fp16_range(name: str, max_abs: float,
                     fix: str = "Use dtype 'bf16' for this cache (same range as float32), or drop this layer.") -> None:
    """Refuse a target whose largest magnitude would turn into inf in float16.

    Args:
        name: the array name (for example ``hidden/6``), used in the message.
        max_abs: the largest |value| seen in that target.
        fix: what the caller's user can do about it (stage one names its ``--dtype bf16`` flag).

    Raises:
        Fp16OverflowError: when ``max_abs`` rounds to inf in float16 (values up to 65519.99 still round to 65504).
    """
    with np.errstate(over="ignore"):  # the overflow is exactly what we are testing for
        overflows = bool(np.isinf(np.float16(np.float32(max_abs)))) or not np.isfinite(max_abs)
    if overflows:
        raise Fp16OverflowError(
            f"{name}: largest |value| is {max_abs:.6g}, beyond the float16 maximum of {FP16_MAX:g}; "
            f"it would be stored as inf. {fix}",
            name=name,
            max_abs=float(max_abs),
        )


def _fp16_finite(values: np.ndarray) -> bool:
    """Whether every float16 value is finite: an exponent of all ones is inf or NaN. Integer ops on the bits
    run several times faster than ``np.isfinite``, which numpy emulates for float16."""
    return not values.size or int((np.ascontiguousarray(values).view(np.uint16) & 0x7FFF).max()) < 0x7C00


def check_finite(name: str, values: np.ndarray) -> None:
    """Raise ``NonFiniteValueError`` naming ``name`` and the count when any value is NaN or inf."""
    finite = _fp16_finite(values) if values.dtype == np.float16 else np.isfinite(values).all()
    if values.size and not finite:
        bad = int(np.size(values) - np.count_nonzero(np.isfinite(values)))
        raise NonFiniteValueError(f"{name}: {bad} value(s) are NaN or inf before conversion; expected finite values")


def float32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (round-to-nearest-even) and return the 16-bit patterns as uint16.

    Args:
        values: float32 array of any shape (must be finite).

    Returns:
        uint16 array of the same shape.
    """
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # Adding 0x7FFF plus the lowest kept bit rounds half-way cases to the even neighbour.
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def to_float32(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """Turn a stored float target (float16, or uint16 bf16 bits) into float32.

    Args:
        array: stored values, any shape.
        dtype_name: the cache's ``spec.dtype`` ("fp16" or "bf16").
    """
    if dtype_name == "bf16":  # widening the bits is exact
        return (np.asarray(array, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    storage_dtype(dtype_name)
    return np.asarray(array).astype(np.float32)


def to_storage(name: str, values: np.ndarray, dtype_name: str, *, finite: bool = False) -> np.ndarray:
    """Convert one float target to its storage dtype, refusing overflow and non-finite values.

    Args:
        name: array name for error messages.
        values: float32/float64 values, or values already in the storage dtype (float16 for fp16, uint16 bits
            for bf16), any shape.
        dtype_name: "fp16" or "bf16".
        finite: values already in the storage dtype were checked finite by their producer (on its device).

    Returns:
        array of the storage dtype, same shape.
    """
    target = storage_dtype(dtype_name)
    if values.dtype == target:  # already converted by the caller
        if dtype_name == "fp16" and not finite:
            check_finite(name, values)
        return values
    if values.dtype.kind != "f":
        raise InvalidSequenceError(f"{name}: expected float32 or {target} values, got dtype {values.dtype}")
    if dtype_name == "bf16":
        check_finite(name, values)
        out = float32_to_bf16_bits(values.astype(np.float32, copy=False))
        if values.size and ((out & 0x7F80) == 0x7F80).any():  # float32 values near max round up to inf
            max_abs = float(np.abs(values).max())
            raise Fp16OverflowError(f"{name}: largest |value| {max_abs:.6g} overflows bf16", name=name, max_abs=max_abs)
        return out
    with np.errstate(over="ignore"):
        out = values.astype(np.float16)
    if not _fp16_finite(out):  # one pass over the small output; diagnose only on failure
        check_finite(name, values)
        check_fp16_range(name, float(np.abs(values).max()))
    return out


def bitround_bits(bits: np.ndarray, mantissa_bits: int, keepbits: int) -> np.ndarray:
    """Keep ``keepbits`` mantissa bits of 16-bit floats, rounding to nearest even (like numcodecs BitRound).

    Args:
        bits: uint16 patterns (float16 or bf16 bits), any shape.
        mantissa_bits: 10 for float16, 7 for bf16.
        keepbits: mantissa bits kept, 0 < keepbits < mantissa_bits.

    Returns:
        uint16 patterns with the dropped bits zeroed (zeros compress, which is the point).
    """
    drop = mantissa_bits - keepbits
    wide = bits.astype(np.uint32)
    half_minus_one = (1 << (drop - 1)) - 1
    rounded: np.ndarray = (wide + half_minus_one + ((wide >> drop) & 1)) & ~np.uint32((1 << drop) - 1)
    return rounded.astype(np.uint16)


def apply_bitround(name: str, stored: np.ndarray, dtype_name: str, keepbits: int) -> np.ndarray:
    """Bitround a stored float target and refuse a result that rounded up to inf.

    Args:
        name: array name for error messages.
        stored: float16 or uint16 (bf16 bits) array, any shape.
        dtype_name: "fp16" or "bf16".
        keepbits: mantissa bits kept.
    """
    mantissa = STORAGE_DTYPES[dtype_name][1]
    out = bitround_bits(stored.view(np.uint16), mantissa, keepbits).view(stored.dtype)
    widened = to_float32(out, dtype_name)
    if out.size and not np.isfinite(widened).all():
        max_abs = float(np.abs(to_float32(stored, dtype_name)).max())
        raise Fp16OverflowError(
            f"{name}: bitround to {keepbits} bits rounds the largest |value| {max_abs:.6g} up to inf; "
            f"use more keepbits or dtype 'bf16'",
            name=name,
            max_abs=max_abs,
        )
    return out


def measure_error(original: np.ndarray, stored: np.ndarray, dtype_name: str) -> dict[str, float]:
    """Max absolute and max relative error of stored values against the values the writer was given.

    Relative error is taken over originals in the storage dtype's normal range (|x| >= 6.1e-5 for fp16):
    below it, subnormals keep fewer bits and zero has no relative error, so the absolute error bounds them.
    """
    ref = original.astype(np.float32, copy=False)
    got = to_float32(stored, dtype_name)
    err = np.abs(got - ref)
    normal = np.abs(ref) >= SMALLEST_NORMAL[dtype_name]
    rel = float((err[normal] / np.abs(ref[normal])).max()) if normal.any() else 0.0
    return {"max_abs_error": float(err.max()) if err.size else 0.0, "max_rel_error": rel}
