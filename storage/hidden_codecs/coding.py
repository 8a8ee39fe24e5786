"""A cache's codec record and the coded arrays of one name: resolve the record, encode and decode ``name`` with
its companions and projection, and summarise the per-row errors. Any array library (``arrays``): numpy here
and in ``verify``, torch tensors on stage one's and stage two's devices (``stages.targets.hidden.device_codecs``).

With a ``rank`` R (``--hidden-rank``), a hidden layer's rows are first projected onto R principal directions
fitted on the teacher's own states and stored in the cache (``storage.projection``): the codec stores the
coefficients ``(x - mean) @ basis.T`` ``[T, R]``, and decoding ends with ``coef @ basis + mean``.

A codec applies to activation token rows ``[T, d]``: hidden states and the cached queries/keys/values
(``CODED_KINDS``). Each coded kind's companions are named ``{kind}_{part}/{j}`` (``hidden_scale/3``,
``attention_q_outliers/3``); ``{kind}_error`` holds the per-row error sums stage one hands the writer (recorded
per shard, never stored).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kdcache.storage.core.attention_source import QKV_KINDS
from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.streams import ArrayKind, kind_of, prefixed, split_stream
from kdcache.storage.hidden_codecs.arrays import Array, namespace, row_errors
from kdcache.storage.hidden_codecs.base import CodecRecord, HiddenCodec, get

CODED_KINDS = ("hidden", *QKV_KINDS)
PARTS = ("scale", "outliers", "outlier_ids")
COMPANION_KINDS: dict[str, tuple[str, str]] = {f"{kind}_{part}": (kind, part) for kind in CODED_KINDS
                                               for part in (*PARTS, "error")}
ERROR_FIELDS = ("err_sq", "ref_sq", "cosine", "max_abs", "decoded_sq")  # the columns of an error array [T, 5]


def part_name(name: str, part: str) -> str:
    """The companion array ``part`` ("scale", "outliers", "outlier_ids", "error") of coded array ``name``:
    ``part_name("encoder/hidden/3", "scale") == "encoder/hidden_scale/3"``."""
    stream, rest = split_stream(name)
    kind, layer = rest.split("/", 1)
    return prefixed(stream, f"{kind}_{part}/{layer}")


def part_of(name: str) -> str | None:
    """The part ("scale", "outliers", "outlier_ids", "error") companion ``name`` holds; None for any other array."""
    companion = COMPANION_KINDS.get(kind_of(name))
    return companion[1] if companion else None


def is_part(name: str) -> bool:
    """Whether ``name`` is a companion (scale, outliers, their ids) or a transient error array."""
    return part_of(name) is not None


def applies_to(name: str) -> bool:
    """Whether a hidden codec applies to array ``name`` (the one predicate; see ``CODED_KINDS``)."""
    return kind_of(name) in CODED_KINDS


Bases = Mapping[str, tuple[Array, Array]]  # array name -> (basis [R, d], mean [d]), in the coded rows' library
_CONFIGURED: dict[tuple[type[HiddenCodec], str], HiddenCodec] = {}


def resolve_hidden_codec(value: object, dtype: str) -> CodecRecord:
    """The full ``{"name", "configuration"}`` record of a codec given as a name, a record, a codec, or None
    (``dtype``).

    Raises:
        SpecError: an unknown name or configuration key, or a bad value.
    """
    if isinstance(value, HiddenCodec):
        return value.record()
    if value is not None and not isinstance(value, (str, dict)):
        raise SpecError(f"hidden codec {value!r}: expected a codec name or a {{name, configuration}} object")
    record: dict[str, Any] = {"name": value or dtype} if value is None or isinstance(value, str) else dict(value)
    name, config = record.get("name"), record.get("configuration") or {}
    if not isinstance(config, dict):
        raise SpecError(f"hidden codec {name!r}: configuration {config!r} is not an object of the codec's keys")
    return get(name).configure(config).record()


def hidden_codec_of(value: object, dtype: str) -> HiddenCodec:
    """The codec a name, a record, a codec or None (``dtype``) stands for, configured (built once per record):
    what an option or a manifest's ``hidden_codec`` becomes at the edge, and then travels as
    (``resolve_hidden_codec``'s errors)."""
    record = resolve_hidden_codec(value, dtype)
    cls = get(record["name"])  # looked up each time: a codec unregistered (a test's own) is no longer found
    key = (cls, repr(sorted(record["configuration"].items())))
    if key not in _CONFIGURED:
        _CONFIGURED[key] = cls.configure(dict(record["configuration"]))
    return _CONFIGURED[key]


def projected(codec: HiddenCodec, name: str) -> bool:
    """Whether coded array ``name`` stores projection coefficients ``[T, R]``: hidden states of a codec with a
    rank (queries/keys/values are coded as they are)."""
    return codec.rank is not None and kind_of(name) == ArrayKind.HIDDEN


def check_width(codec: HiddenCodec, name: str, d: int) -> None:
    """Refuse a width the codec cannot store (int4 groups must divide d; outlier ids fit uint16); d is the rank
    R for projection coefficients."""
    expected = codec.width_expectation(d)
    if expected:
        what = f"projection rank {d}" if projected(codec, name) else f"hidden size {d}"
        raise SpecError(f"{name}: {what} does not suit codec {codec.name!r}: expected {expected}")


def _basis(codec: HiddenCodec, name: str, projection: Bases | None) -> tuple[Array, Array]:
    """(basis ``[R, d]``, mean ``[d]``) of projected array ``name``, or a SpecError naming what is missing."""
    if projection is None or name not in projection:
        raise SpecError(f"{name}: stored as rank-{codec.rank} projection coefficients, but no basis for it "
                        f"was given (a cache holds them in its projection/ folder)")
    return projection[name]


def encode(codec: HiddenCodec, name: str, x: Array, projection: Bases | None = None) -> dict[str, Array]:
    """Encode ``x [T, d]`` (any array library, on its device) -> the stored arrays of ``name`` (codes and
    companions, ``part_name``) and its per-row errors ``[T, 5]`` (``row_errors``), measured against ``x`` itself
    so that a projection's loss shows in them.

    Args:
        projection: a rank codec's ``{name: (basis [R, d], mean [d])}``: ``(x - mean) @ basis.T`` ``[T, R]`` is
            what is coded.

    Raises:
        SpecError: d does not suit the codec (int4 needs d divisible by its group); no basis for a projected name.
    """
    xp = namespace(x)
    x = xp.astype(x, xp.float32, copy=False)
    coded = x
    if projected(codec, name):
        basis, mean = _basis(codec, name, projection)
        coded = xp.astype((x - mean) @ basis.T, xp.float32)
    check_width(codec, name, coded.shape[1])
    stored = codec.encode_rows(coded)
    decoded = codec.decode_rows(stored)
    if projected(codec, name):
        decoded = decoded @ xp.astype(basis, xp.float32) + xp.astype(mean, xp.float32)
    out = {name: stored["codes"], **{part_name(name, p): stored[p] for p in PARTS if p in stored}}
    out[part_name(name, "error")] = row_errors(x, decoded)
    return out


def decode(codec: HiddenCodec, arrays: Mapping[str, Array], name: str,
           projection: Bases | None = None) -> Array:
    """Decode coded array ``name`` -> ``[T, d]`` float32 (any array library).

    Args:
        codec: the cache's (``spec.hidden_codec``).
        arrays: the stored arrays by name: ``name`` (codes ``[T, d']``) and its companions (``part_name``).
        name: e.g. ``hidden/3``.
        projection: a rank codec's ``{name: (basis [R, d], mean [d])}`` (``storage.projection``): the decoded
            coefficients ``[T, R]`` become ``coef @ basis + mean``.

    Raises:
        SpecError: ``name`` is projected and ``projection`` has no basis for it.
    """
    stored = {"codes": arrays[name], **{p: arrays[part_name(name, p)] for p in PARTS
                                        if part_name(name, p) in arrays}}
    y = codec.decode_rows(stored)
    if not projected(codec, name):
        return y
    xp = namespace(y)
    basis, mean = _basis(codec, name, projection)
    return y @ xp.astype(basis, xp.float32) + xp.astype(mean, xp.float32)


def error_record(codec: HiddenCodec, rows: np.ndarray) -> dict[str, Any]:
    """One shard's error record of a coded array, from its per-row errors ``[T, 5]`` (``row_errors``)."""
    sums = rows.astype(np.float64)
    ref = float(sums[:, 1].sum())
    return {"codec": codec.name, "rel_rms_error": float(np.sqrt(sums[:, 0].sum() / ref)) if ref else 0.0,
            "worst_row_cosine": float(sums[:, 2].min(initial=1.0)), "max_abs_error": float(sums[:, 3].max(initial=0)),
            "decoded_sq": float(sums[:, 4].sum())}
