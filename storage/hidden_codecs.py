"""Hidden-state codecs: a registry by name, the arrays each one stores, and the numpy reference encode/decode.

A codec is recorded in the spec as ``{"name": ..., "configuration": {...}}`` (like a zarr v3 codec). Two kinds:

* float codecs (``fp16``, ``bf16``): the layer is stored as that float type, as before this registry existed;
* quantised codecs (``fp8``, ``int8``, ``int7``, ``int4``): the layer ``x [T, d]`` is stored as plain arrays

  - ``hidden/{j}``: codes ``[T, d]`` (int8 and int7 as int8; fp8 e4m3 bit patterns as uint8) or ``[T, d/2]``
    (int4: two codes per uint8, the even channel in the low nibble, each stored as ``q + 8``);
  - ``hidden_scale/{j}``: fp16 scales ``[T, G]``, one per row (G = 1) or per group of ``group`` channels (int4);
  - ``hidden_outliers/{j}`` (fp16) and ``hidden_outlier_ids/{j}`` (uint16) ``[T, m]`` when ``outliers`` m > 0:
    each row's m largest |values|, kept aside exactly (fp16) and subtracted before quantising.

  Decoding (docs/cache-format.md): ``y = dequant(codes) * scale``; ``x = signs * H(y)`` per block of ``b``
  channels when ``rotation`` is a seed (``H`` the orthonormal Sylvester-Hadamard matrix, ``b`` the largest power
  of two dividing d but at most 256, ``signs`` = ``default_rng(seed).integers(0, 2, d) * 2 - 1``); then
  ``x[ids] += outliers``.

  With a ``rank`` R (``--hidden-rank``), a hidden layer's rows are first projected onto R principal directions
  fitted on the teacher's own states and stored in the cache (``storage.projection``): the codec stores the
  coefficients ``(x - mean) @ basis.T`` ``[T, R]`` as above, and decoding ends with ``coef @ basis + mean``.

  ``pca8`` (transform coding) always has R = d: int8 codes of the full-rank coefficients at a scale of ``step``
  x each row's RMS, no rotation, no outliers; zarr stores its codes column-major (``COLUMN_CODES_CODEC``).

Why a rotation: real activations have a few channels 100-1000x larger than the rest, and one scale per row set
by those flattens every other channel to zero; a seeded random rotation spreads them over a block first. The
largest few are also kept aside, because even spread they dominate the row's scale.

Everything here is numpy; stage one and stage two use the torch twin in ``stages.common.hidden_codecs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kdcache.storage.attention_source import QKV_KINDS
from kdcache.storage.errors import SpecError
from kdcache.storage.rotation import block_size as block_size  # re-exported: the codecs' rotation, by its old path
from kdcache.storage.rotation import hadamard as hadamard
from kdcache.storage.rotation import hadamard_matrix as hadamard_matrix
from kdcache.storage.rotation import rotation_signs as rotation_signs
from kdcache.storage.streams import kind_of, prefixed, split_stream

# The array kinds a hidden codec applies to: hidden states and the cached queries/keys/values, all activation
# token rows [T, d]. Each coded kind's companions are named ``{kind}_{part}/{j}`` (``hidden_scale/3``,
# ``attention_q_outliers/3``); ``{kind}_error`` holds the per-row error sums stage one hands the writer (recorded
# per shard, never stored).
CODED_KINDS = ("hidden", *QKV_KINDS)
PARTS = ("scale", "outliers", "outlier_ids")
COMPANION_KINDS: dict[str, tuple[str, str]] = {f"{kind}_{part}": (kind, part) for kind in CODED_KINDS
                                               for part in (*PARTS, "error")}
ERROR_FIELDS = ("err_sq", "ref_sq", "cosine", "max_abs", "decoded_sq")  # the columns of an error array [T, 5]
FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass(frozen=True)
class HiddenCodec:
    """One registered codec.

    Attributes:
        name: as recorded.
        float_dtype: "fp16" / "bf16" for a float codec, None for a quantised one.
        code_dtype: numpy dtype of the stored codes (quantised codecs).
        qmax: the largest code magnitude (127 for int8, 7 for int4, 448 for fp8).
        per_code: values per stored code element (2 for int4's packed nibbles).
        grouped: one scale per ``group`` channels rather than one per row.
        rms_step: the row's scale is ``step`` x the RMS of its values (a uniform quantiser, codes clipped at qmax)
            rather than its largest |value| / qmax; for decorrelated coefficients that spend the bits evenly.
        full_rank: coded only as full-rank projection coefficients (``rank`` = d: a PCA basis, no reduction).
        column_major: zarr stores its codes direction by direction (a byte shuffle of each row before zstd).
    """

    name: str
    float_dtype: str | None = None
    code_dtype: np.dtype | None = None
    qmax: float = 0.0
    per_code: int = 1
    grouped: bool = False
    rms_step: bool = False
    full_rank: bool = False
    column_major: bool = False


HIDDEN_CODECS: dict[str, HiddenCodec] = {codec.name: codec for codec in (
    HiddenCodec("fp16", float_dtype="fp16"),
    HiddenCodec("bf16", float_dtype="bf16"),
    HiddenCodec("fp8", code_dtype=np.dtype(np.uint8), qmax=FP8_MAX),
    HiddenCodec("int8", code_dtype=np.dtype(np.int8), qmax=127.0),
    # 7-bit codes (-63..63) in int8 bytes: zstd's entropy coding stores them in ~6.4 bits (2.2x smaller than
    # fp16 on MiniLM, benchmarks/RESULTS.md) at twice int8's error, still well inside 0.1% of every hidden loss.
    HiddenCodec("int7", code_dtype=np.dtype(np.int8), qmax=63.0),
    HiddenCodec("int4", code_dtype=np.dtype(np.uint8), qmax=7.0, per_code=2, grouped=True),
    # Transform coding (issue 22): a full-rank PCA decorrelates the channels and sorts them by variance, so one
    # uniform step per row spends ~4 bits on the leading directions and ~0 on the tail once zstd sees each
    # direction's codes together (4.05x smaller than fp16 within 1% of every hidden loss on MiniLM at step 0.24).
    HiddenCodec("pca8", code_dtype=np.dtype(np.int8), qmax=127.0, rms_step=True, full_rank=True, column_major=True),
)}
DEFAULTS = {"rotation": 0, "outliers": 4, "group": 64}  # a quantised codec's configuration when not given
# An RMS-step codec's own: no rotation (it would mix the sorted directions again), no outliers (a PCA
# coefficient has none worth an fp16 copy), and the step measured best (benchmarks/RESULTS.md).
RMS_DEFAULTS = {"rotation": None, "outliers": 0, "group": 64, "step": 0.24}
# Codes are near-Gaussian bytes: zstd's entropy coding shrinks them (int8 by ~7%, int7 by ~20%), and bit-shuffling
# them first, which helps fp16, hides that (measured in benchmarks/RESULTS.md). Zarr caches compress them so.
CODES_CODEC: dict[str, Any] = {"id": "blosc", "cname": "zstd", "clevel": 5, "shuffle": 0, "blocksize": 0}
# A column-major codec's codes: after the row shuffle each zstd block holds a few directions of one variance
# each; level 9 over 1 MiB blocks is what reached 4.05x (level 5 loses ~0.1x of it).
COLUMN_CODES_CODEC: dict[str, Any] = {"id": "blosc", "cname": "zstd", "clevel": 9, "shuffle": 0,
                                      "blocksize": 1 << 20}


def resolve_hidden_codec(value: object, dtype: str) -> dict[str, Any]:
    """The full ``{"name", "configuration"}`` record of a codec given as a name, a record, or None (``dtype``).

    Raises:
        SpecError: an unknown name or configuration key, or a bad value.
    """
    if value is not None and not isinstance(value, (str, dict)):
        raise SpecError(f"hidden codec {value!r}: expected a codec name or a {{name, configuration}} object")
    record: dict[str, Any] = {"name": value or dtype} if value is None or isinstance(value, str) else dict(value)
    name, config = record.get("name"), record.get("configuration") or {}
    if not isinstance(config, dict):
        raise SpecError(f"hidden codec {name!r}: configuration {config!r} is not an object; expected keys "
                        f"{sorted(DEFAULTS)}")
    if name not in HIDDEN_CODECS:
        raise SpecError(f"unknown hidden codec {name!r}; expected one of {sorted(HIDDEN_CODECS)}")
    if HIDDEN_CODECS[name].float_dtype:
        if config:
            raise SpecError(f"hidden codec {name!r} takes no configuration, got {config}")
        return {"name": name, "configuration": {}}
    defaults = RMS_DEFAULTS if HIDDEN_CODECS[name].rms_step else DEFAULTS
    unknown = sorted(set(config) - set(defaults) - {"rank"})
    if unknown:
        raise SpecError(f"hidden codec {name!r}: unknown configuration {unknown}; expected keys "
                        f"{sorted([*defaults, 'rank'])}")
    config = {**defaults, **config}
    if HIDDEN_CODECS[name].rms_step:
        _check_rms_step(name, config)
    if config.get("rank", 0) is None:  # no projection: the record of a codec without one (same fingerprint)
        del config["rank"]
    if "rank" in config and not (_is_int(config["rank"]) and config["rank"] >= 1):
        raise SpecError(f"hidden codec {name!r}: rank must be an integer >= 1 (the projection's R), got "
                        f"{config['rank']!r}")
    rotation, outliers, group = config["rotation"], config["outliers"], config["group"]
    if rotation is not None and not (_is_int(rotation) and rotation >= 0):
        raise SpecError(f"hidden codec rotation must be a seed >= 0 or null, got {rotation!r}")
    if not (_is_int(outliers) and 0 <= outliers <= 64 and _is_int(group) and group >= 2 and group % 2 == 0):
        raise SpecError(f"hidden codec {name!r}: outliers must be an integer 0..64 and group an even integer >= 2, "
                        f"got {outliers!r} and {group!r}")
    return {"name": name, "configuration": config}


def _check_rms_step(name: str, config: dict[str, Any]) -> None:
    """Refuse an RMS-step codec's bad step, and a rotation or outliers (its decode applies neither)."""
    step = config["step"]
    if not (isinstance(step, (int, float)) and not isinstance(step, bool) and 0 < step <= 8):
        raise SpecError(f"hidden codec {name!r}: step must be a number in (0, 8] (the quantisation step as a "
                        f"fraction of each row's RMS), got {step!r}")
    if config["rotation"] is not None or config["outliers"] != 0:
        raise SpecError(f"hidden codec {name!r} takes no rotation and no outliers (expected rotation null and "
                        f"outliers 0), got rotation {config['rotation']!r} and outliers {config['outliers']!r}")


def _is_int(value: object) -> bool:
    """Whether ``value`` is an integer, and not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def group_count(record: dict[str, Any], d: int) -> int:
    """Scales per row for hidden size d: one, or one per ``group`` channels (the whole row when d <= group)."""
    return d // min(record["configuration"]["group"], d) if codec_of(record).grouped else 1


def codec_of(record: dict[str, Any]) -> HiddenCodec:
    """The registered codec of a resolved record."""
    return HIDDEN_CODECS[record["name"]]


def part_name(name: str, part: str) -> str:
    """The companion array ``part`` ("scale", "outliers", "outlier_ids", "error") of coded array ``name``:
    ``part_name("encoder/hidden/3", "scale") == "encoder/hidden_scale/3"``."""
    stream, rest = split_stream(name)
    kind, layer = rest.split("/", 1)
    return prefixed(stream, f"{kind}_{part}/{layer}")


def coded_of(name: str) -> str:
    """The coded array a companion belongs to: ``coded_of("attention_q_scale/3") == "attention_q/3"``."""
    stream, rest = split_stream(name)
    kind, layer = rest.split("/", 1)
    return prefixed(stream, f"{COMPANION_KINDS[kind][0]}/{layer}")


def part_of(name: str) -> str | None:
    """The part ("scale", "outliers", "outlier_ids", "error") companion ``name`` holds; None for any other array."""
    companion = COMPANION_KINDS.get(kind_of(name))
    return companion[1] if companion else None


def is_part(name: str) -> bool:
    """Whether ``name`` is a companion (scale, outliers, their ids) or a transient error array."""
    return part_of(name) is not None


def parts(record: dict[str, Any]) -> tuple[str, ...]:
    """The companion parts a codec stores beside its codes (none for a float codec)."""
    if codec_of(record).float_dtype:
        return ()
    return ("scale", "outliers", "outlier_ids") if record["configuration"]["outliers"] else ("scale",)


def rank_of(record: dict[str, Any]) -> int | None:
    """The projection's rank R of a resolved record (``configuration.rank``), None without a projection."""
    rank: int | None = record["configuration"].get("rank")
    return rank


def projected(record: dict[str, Any], name: str) -> bool:
    """Whether coded array ``name`` stores projection coefficients ``[T, R]``: hidden states of a codec with a
    rank (queries/keys/values are coded as they are)."""
    return rank_of(record) is not None and kind_of(name) == "hidden"


def applies_to(name: str) -> bool:
    """Whether a hidden codec applies to array ``name`` (the one predicate; see ``CODED_KINDS``)."""
    return kind_of(name) in CODED_KINDS


def fp8_table() -> np.ndarray:
    """The float32 value of every e4m3fn bit pattern ``[256]`` (0x7F and 0xFF are NaN and never written)."""
    bits = np.arange(256)
    exponent, mantissa = (bits >> 3) & 15, (bits & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(bits >> 7, -magnitude, magnitude)
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


def dequantize(record: dict[str, Any], codes: np.ndarray) -> np.ndarray:
    """Integer codes ``[T, d']`` -> quantised values ``[T, d]`` float32 (before the scale)."""
    name = record["name"]
    if name == "fp8":
        return fp8_table()[codes.astype(np.intp)]
    if name == "int4":
        low, high = (codes & 15).astype(np.int16) - 8, (codes >> 4).astype(np.int16) - 8
        return np.stack([low, high], axis=-1).reshape(codes.shape[0], -1).astype(np.float32)
    return codes.astype(np.float32)


def decode(record: dict[str, Any], arrays: dict[str, np.ndarray], name: str,
           projection: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> np.ndarray:
    """The numpy reference decode of coded array ``name`` -> ``[T, d]`` float32.

    Args:
        record: the resolved codec record (``spec.hidden_codec``).
        arrays: the stored arrays by name: ``name`` (codes) and its companions (``part_name``).
        name: e.g. ``hidden/3``.
        projection: a rank codec's ``{name: (basis [R, d], mean [d])}`` (``storage.projection``): the decoded
            coefficients ``[T, R]`` become ``coef @ basis + mean``.

    Raises:
        SpecError: ``name`` is projected and ``projection`` has no basis for it.
    """
    y = _decode_codes(record, arrays, name)
    if not projected(record, name):
        return y
    basis, mean = _basis(record, name, projection)
    return y @ basis.astype(np.float32) + mean.astype(np.float32)


def _basis(record: dict[str, Any], name: str, projection: dict[str, tuple[np.ndarray, np.ndarray]] | None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(basis ``[R, d]``, mean ``[d]``) of projected array ``name``, or a SpecError naming what is missing."""
    if projection is None or name not in projection:
        raise SpecError(f"{name}: stored as rank-{rank_of(record)} projection coefficients, but no basis for it "
                        f"was given (a cache holds them in its projection/ folder)")
    return projection[name]


def _decode_codes(record: dict[str, Any], arrays: dict[str, np.ndarray], name: str) -> np.ndarray:
    """Codes and companions of ``name`` -> the coded rows ``[T, w]`` float32 (coefficients when projected)."""
    config = record["configuration"]
    y = dequantize(record, arrays[name])
    scale = arrays[part_name(name, "scale")].astype(np.float32)
    n, d = y.shape
    y = (y.reshape(n, scale.shape[1], -1) * scale[:, :, None]).reshape(n, d)
    if config["rotation"] is not None:
        y = hadamard(y) * rotation_signs(config["rotation"], y.shape[1])
    if config["outliers"]:
        rows = np.arange(len(y))[:, None]
        y[rows, arrays[part_name(name, "outlier_ids")].astype(np.intp)] += \
            arrays[part_name(name, "outliers")].astype(np.float32)
    return y


def _fp8_codes(v: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn bit pattern of each value (already within +-448)."""
    table = fp8_table()[:127]  # the non-negative finite patterns 0x00..0x7E, increasing
    mag = np.minimum(np.abs(v), FP8_MAX)
    upper = np.clip(np.searchsorted(table, mag), 1, 126)
    nearer = np.where(mag - table[upper - 1] <= table[upper] - mag, upper - 1, upper)
    codes: np.ndarray = (nearer | np.where(v < 0, 128, 0)).astype(np.uint8)
    return codes


def _quantize(record: dict[str, Any], y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rotated rows ``[T, d]`` -> (codes ``[T, d']``, fp16 scales ``[T, G]``)."""
    codec, t = codec_of(record), len(y)
    blocks = y.reshape(t, group_count(record, y.shape[1]), -1)
    if codec.rms_step:  # a uniform step; the rare value past qmax steps is clipped
        scale = (record["configuration"]["step"] * np.sqrt((blocks ** 2).mean(axis=-1))).astype(np.float16)
    else:  # the fp16 scale is rounded up so that no scaled value passes qmax (fp8 would otherwise reach NaN)
        scale = _scale_up(np.abs(blocks).max(axis=-1) / codec.qmax)
    safe = np.where(scale > 0, scale.astype(np.float32), 1.0)[:, :, None]
    scaled = np.clip(blocks / safe, -codec.qmax, codec.qmax).reshape(t, -1)
    if codec.name == "fp8":
        return _fp8_codes(scaled), scale
    q = np.rint(scaled).astype(np.int16)
    if codec.name == "int4":
        nibbles = (q + 8).astype(np.uint8).reshape(t, -1, 2)
        return (nibbles[..., 0] | (nibbles[..., 1] << 4)).astype(np.uint8), scale
    return q.astype(np.int8), scale


def _scale_up(scale: np.ndarray) -> np.ndarray:
    """float32 scales -> fp16, rounded towards +inf (never below the float32 value)."""
    half = scale.astype(np.float16)
    low = half.astype(np.float32) < scale
    return np.where(low, np.nextafter(half, np.float16(np.inf)), half).astype(np.float16)


def encode(record: dict[str, Any], name: str, x: np.ndarray,
           projection: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
    """The numpy reference encode of ``x [T, d]`` float32 -> the stored arrays of ``name`` and its error rows
    (measured against ``x`` itself, so a projection's loss shows in them).

    Args:
        projection: a rank codec's ``{name: (basis [R, d], mean [d])}``: ``(x - mean) @ basis.T`` ``[T, R]`` is
            what is coded.

    Raises:
        SpecError: d does not suit the codec (int4 needs d divisible by its group); no basis for a projected name.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    coded = x
    if projected(record, name):
        basis, mean = _basis(record, name, projection)
        coded = np.ascontiguousarray((x - mean) @ basis.T, dtype=np.float32)
    out = _encode_rows(record, name, coded)
    out[part_name(name, "error")] = row_errors(x, decode(record, out, name, projection))
    return out


def _encode_rows(record: dict[str, Any], name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """Rows ``[T, w]`` float32 -> codes and companions of ``name`` (outliers kept aside, rotated, quantised)."""
    config = record["configuration"]
    check_width(record, name, x.shape[1])
    out: dict[str, np.ndarray] = {}
    residual = x.copy()
    if config["outliers"]:
        m = min(config["outliers"], x.shape[1])
        ids = np.sort(np.argpartition(-np.abs(x), m - 1, axis=1)[:, :m], axis=1)
        rows = np.arange(len(x))[:, None]
        values = x[rows, ids].astype(np.float16)
        residual[rows, ids] -= values.astype(np.float32)  # the fp16 rounding stays in the quantised residual
        out[part_name(name, "outliers")], out[part_name(name, "outlier_ids")] = values, ids.astype(np.uint16)
    if config["rotation"] is not None:
        residual = hadamard(residual * rotation_signs(config["rotation"], x.shape[1]))
    out[name], out[part_name(name, "scale")] = _quantize(record, residual)
    return out


def check_width(record: dict[str, Any], name: str, d: int) -> None:
    """Refuse a width the codec cannot store (int4 groups must divide d; outlier ids fit uint16); d is the rank
    R for projection coefficients."""
    group = min(record["configuration"]["group"], d)
    if (codec_of(record).grouped and d % group) or d > 32767:
        what = f"projection rank {d}" if projected(record, name) else f"hidden size {d}"
        raise SpecError(f"{name}: {what} does not suit codec {record['name']!r}: expected d <= 32767"
                        + (f" and divisible by its group {group}" if codec_of(record).grouped else ""))


def row_errors(x: np.ndarray, decoded: np.ndarray) -> np.ndarray:
    """Per row: squared error, squared norm, cosine (1 for two zero rows), max |error| and the decoded row's
    squared norm (which ``verify`` recomputes from the codes) -> ``[T, 5]`` float32."""
    err = decoded - x
    ref_sq, decoded_sq = (x ** 2).sum(1), (decoded ** 2).sum(1)  # each once: the norms reuse them
    dot, norms = (x * decoded).sum(1), np.sqrt(ref_sq * decoded_sq)
    cosine = np.where(norms > 0, dot / np.where(norms > 0, norms, 1.0), 1.0)
    return np.stack([(err ** 2).sum(1), ref_sq, cosine, np.abs(err).max(1, initial=0.0), decoded_sq],
                    axis=1).astype(np.float32)


def error_record(record: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """One shard's error record of a coded array, from its per-row errors ``[T, 5]`` (``row_errors``)."""
    sums = rows.astype(np.float64)
    ref = float(sums[:, 1].sum())
    return {"codec": record["name"], "rel_rms_error": float(np.sqrt(sums[:, 0].sum() / ref)) if ref else 0.0,
            "worst_row_cosine": float(sums[:, 2].min(initial=1.0)), "max_abs_error": float(sums[:, 3].max(initial=0)),
            "decoded_sq": float(sums[:, 4].sum())}
