"""Pure encoding of one shard: per-sequence dicts in, flat token-major arrays out. No I/O here.

Encoding is kept apart from flushing so that it can be tested alone, run in a worker thread, and so that a
failed check (overflow, bad shape) never leaves anything on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kdcache.storage.core.dtypes import FP16_MAX, apply_bitround, check_finite, measure_error, to_float32, to_storage
from kdcache.storage.core.errors import Fp16OverflowError, InvalidSequenceError, ShardError
from kdcache.storage.core.logit_layouts import TOPK_MASS
from kdcache.storage.core.streams import ArrayKind, prefixed
from kdcache.storage.hidden_codecs import (
    ERROR_FIELDS,
    encode,
    error_record,
    part_name,
)
from kdcache.storage.layout import attention_rows, document_lengths, pack_attention, to_gaps
from kdcache.storage.schema.arrays import TOKEN_KINDS, CachedArray
from kdcache.storage.schema.spec import CacheSpec

Concatenate = Callable[[Sequence[np.ndarray]], np.ndarray]  # np.concatenate along axis 0, or a pooled one


@dataclass
class EncodedShard:
    """One shard, ready to flush.

    Attributes:
        index: shard number.
        seq_start, seq_stop: global sequence range ``[seq_start, seq_stop)``.
        arrays: array name -> flat array (see ``CacheSpec.array_names``), e.g. ``hidden/3 [T, d]``.
        num_tokens: T, the valid tokens in the shard.
        lossy: array name -> ``{"keepbits", "max_abs_error", "max_rel_error"}`` for bitrounded arrays,
            ``{"step", "max_abs_error"}`` for quantised top-k log-probs (the largest |stored - given| log-prob),
            and ``{"codec", "rel_rms_error", "worst_row_cosine", "max_abs_error", "decoded_sq"}`` for arrays of a
            quantised hidden codec (``storage.hidden_codecs.error_record``).
    """

    index: int
    seq_start: int
    seq_stop: int
    arrays: dict[str, np.ndarray]
    num_tokens: int
    lossy: dict[str, dict[str, float]] = field(default_factory=dict)


def _fail(seq: int, name: str, problem: str) -> InvalidSequenceError:
    return InvalidSequenceError(f"sequence {seq} (global), array {name!r}: {problem}")


def _expected_shape(spec: CacheSpec, array: CachedArray, lengths: Mapping[str, int],
                    value: np.ndarray) -> tuple[int, ...] | None:
    """The shape ``value`` must have; None entries in the rule are free dims fixed by the first sequence.

    ``lengths`` maps each token stream ("" or "encoder"/"decoder") to this sequence's token count.
    """
    if array.geometry is not None:
        queries, keys = array.geometry.queries, array.geometry.keys
        return (value.shape[0], lengths[queries], lengths[keys]) if value.ndim == 3 else None
    length, logit = lengths[array.stream], array.logit  # a logit array's layout names its width's field
    if array.kind in TOKEN_KINDS or array.name == TOPK_MASS or (logit is not None and logit.width is None):
        return (length,)
    if array.part == "error":  # a coded layer's per-row errors (hidden_codecs.ERROR_FIELDS)
        return (length, len(ERROR_FIELDS))
    # token rows of one width per layer: hidden states (and their codec's companions), queries, keys, values
    if array.token_rows or array.part is not None:
        return (length, value.shape[-1]) if value.ndim == 2 else None
    return (length, int(getattr(spec, logit.width)) if logit and logit.width else spec.top_k)


def _check_sequence(spec: CacheSpec, seq: int, item: Mapping[str, Any]) -> dict[str, int]:
    """Validate one sequence's arrays; returns its length per token stream."""
    arrays = spec.arrays()
    expected = [array.name for array in arrays]
    extra = [spec.array(name) for name in item if name not in expected]
    for array in extra:
        if array.part != "error" and array.name != TOPK_MASS:
            spec.check_name(array.name)  # raises the typed unknown-feature / layer error
    missing = [n for n in expected if n not in item]
    if missing:
        raise _fail(seq, missing[0], f"missing; every sequence needs {expected}")
    lengths = {}
    for stream in spec.streams:
        ids = np.asarray(item[spec.ids_name(stream)])
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise _fail(seq, spec.ids_name(stream), f"expected a non-empty 1-D integer array, got {ids.dtype} "
                                                    f"{ids.shape}")
        lengths[stream] = int(ids.size)
    for array in arrays + extra:
        value = np.asarray(item[array.name])
        shape = _expected_shape(spec, array, lengths, value)
        if shape != value.shape:
            raise _fail(seq, array.name, f"shape {value.shape}, expected {shape or 'a different rank'} for "
                                         f"lengths {lengths}")
    return lengths


def _check_ids(spec: CacheSpec, name: str, ids: np.ndarray) -> None:
    if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= spec.vocab_size)):
        raise InvalidSequenceError(f"{name}: expected integer ids in 0..{spec.vocab_size - 1}, "
                                   f"got dtype {ids.dtype} range {ids.min()}..{ids.max()}")


def _check_descending(spec: CacheSpec, name: str, values: np.ndarray) -> None:
    wide = values if values.dtype.kind == "f" else to_float32(values, spec.dtype)
    if values.size and not (wide[:, :-1] >= wide[:, 1:]).all():
        raise InvalidSequenceError(f"{name}: each token's values must be sorted in descending order")


def _float_target(spec: CacheSpec, name: str, values: np.ndarray, lossy: dict[str, dict[str, float]],
                  finite: bool = False) -> np.ndarray:
    """Convert to the storage dtype, then bitround activations if the spec asks for it."""
    stored = to_storage(name, values, spec.float_dtype(name), finite=finite)
    if spec.bitround is None or not spec.is_lossy_kind(name) or spec.coded(name):  # bitround: activations only
        return stored
    rounded = apply_bitround(name, stored, spec.dtype, spec.bitround)
    original = values if values.dtype.kind == "f" else to_float32(values, spec.dtype)
    lossy[name] = {"keepbits": spec.bitround, **measure_error(original, rounded, spec.dtype)}
    return rounded


def _integer_tokens(array: CachedArray, flat: np.ndarray) -> np.ndarray:
    """Range-check an integer array (ids, loss mask, positions, a logit array's) and narrow it to its dtype."""
    name, dtype = array.name, array.dtype
    top = 1 if array.kind == ArrayKind.LOSS_MASK else np.iinfo(dtype).max
    if flat.dtype.kind not in "iub" or flat.min() < 0 or flat.max() > top:
        raise InvalidSequenceError(f"{name}: expected integers in 0..{top}, got {flat.dtype} values "
                                   f"{flat.min()}..{flat.max()}")
    return flat.astype(dtype)


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int64)


def encode_shard(spec: CacheSpec, index: int, sequences: Sequence[Mapping[str, Any]], *,
                 finite: frozenset[str] = frozenset(), concatenate: Concatenate = np.concatenate) -> EncodedShard:
    """Encode shard ``index`` from one dict per sequence.

    Args:
        index: shard number; fixes the global range through ``spec.shard_range``.
        sequences: one mapping per sequence of the shard: ``input_ids [L]``, ``hidden/{j} [L, d]``,
            ``attention/{j} [H, L, L]`` (all heads), ``logits/full [L, V]``, ``logits/topk_values [L, k]``,
            ``logits/topk_ids [L, k]``, ``logits/lse [L]``. Floats as float32 or already in the storage dtype.
            A seq2seq spec takes ``encoder/input_ids [L_e]``, ``decoder/input_ids [L_d]``, the same targets
            under ``encoder/`` and ``decoder/``, ``cross_attention/{j} [H, L_d, L_e]``, and logits ``[L_d, ...]``.
        finite: float arrays already in the storage dtype whose every value the producer checked finite (stage
            one does on its device): the host pass over them is skipped, being work done twice.
        concatenate: joins an array's per-sequence parts; ``CacheWriter`` passes a ``buffers.Lease``'s, whose
            arrays live in reused buffers until the shard is committed.

    Returns:
        The shard's flat arrays, ready for a backend.

    Raises:
        ShardError, InvalidSequenceError, UnknownFeatureError, LayerNotInCacheError, Fp16OverflowError.
    """
    if not 0 <= index < spec.num_shards:
        raise ShardError(f"shard index {index} out of range; this cache has shards 0..{spec.num_shards - 1}")
    start, stop = spec.shard_range(index)
    if len(sequences) != stop - start:
        raise ShardError(f"shard {index} covers sequences [{start}, {stop}) = {stop - start} sequences, "
                         f"got {len(sequences)}")
    sequences = [_coded(spec, item) for item in sequences]
    lengths = [_check_sequence(spec, start + i, item) for i, item in enumerate(sequences)]
    documents = _documents(spec, sequences)
    arrays = _all_offsets(spec, lengths, documents)
    lossy: dict[str, dict[str, float]] = {}
    for array in spec.arrays():
        name = array.name
        arrays[name] = _encode_array(spec, array, [np.asarray(item[name]) for item in sequences], lossy,
                                     _stream_documents(array, documents), finite=name in finite,
                                     concatenate=concatenate)
        if array.coded:
            if any(part_name(name, "error") not in item for item in sequences):
                raise _fail(start, part_name(name, "error"), "missing; codes made by a codec come with their "
                                                             "per-row errors [L, 5]")
            errors = np.concatenate([np.asarray(item[part_name(name, "error")]) for item in sequences])
            lossy[name] = error_record(spec.hidden_codec, errors)
    _logit_rules(spec, sequences, arrays, lossy)
    # A seq2seq shard's token count is both streams' tokens: what its bytes are spread over.
    return EncodedShard(index, start, stop, arrays, int(sum(sum(n.values()) for n in lengths)), lossy)


def _logit_rules(spec: CacheSpec, sequences: Sequence[Mapping[str, Any]], arrays: dict[str, np.ndarray],
                 lossy: dict[str, dict[str, float]]) -> None:
    """The layout's rules over a shard's logit arrays, each over all of them in turn (so that which error a bad
    shard raises first stays put): sorted rows and the kept probability mass; ids in range, narrowed to their
    dtype; rising rows stored as gaps."""
    logits = [(a, a.logit) for a in spec.arrays() if a.logit is not None]
    for array, logit in logits:
        if logit.descending:
            _check_descending(spec, array.name, arrays[array.name])
        if logit.mass and all(TOPK_MASS in item for item in sequences):
            mass = np.concatenate([np.asarray(item[TOPK_MASS], dtype=np.float64) for item in sequences])
            lossy.setdefault(array.name, {}).update(_mass_record(mass))
    for array in (a for a, _ in logits if a.vocab_ids):
        _check_ids(spec, array.name, arrays[array.name])
        arrays[array.name] = arrays[array.name].astype(array.dtype)
    for array in (a for a, _ in logits if a.gap_coded):
        arrays[array.name] = _gaps(array, arrays[array.name])


def _coded(spec: CacheSpec, item: Mapping[str, Any]) -> Mapping[str, Any]:
    """A sequence whose coded arrays are given as floats ``[L, d]``, encoded here by the numpy reference codec
    (stage one hands codes, scales and per-row errors made on its device instead, leaving nothing to do)."""
    floats = [n for n in item if spec.coded(n) and np.asarray(item[n]).dtype.kind == "f"]
    if not floats:
        return item
    out = dict(item)
    for name in floats:
        values = np.asarray(item[name], dtype=np.float32)
        if values.ndim != 2:
            raise InvalidSequenceError(f"{name}: expected [L, d] floats, got shape {values.shape}")
        check_finite(name, values)  # NaN is not an overflow: name it for what it is
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found below and named with its limit
            out.update(encode(spec.hidden_codec, name, values))
        stored = [out[part_name(name, p)] for p in spec.hidden_codec.parts() if p != "outlier_ids"]
        if not all(np.isfinite(a).all() for a in stored):
            max_abs = float(np.abs(values).max())
            raise Fp16OverflowError(f"{name}: largest |value| {max_abs:.6g} gives a scale or an outlier beyond "
                                    f"float16; expected values within +-{_coded_limit(spec):g} for hidden codec "
                                    f"{spec.hidden_codec.name!r}", name=name, max_abs=max_abs)
    return out


def _coded_limit(spec: CacheSpec) -> float:
    """The largest |value| a quantised codec stores: outliers are kept as float16, else the fp16 scale
    (max / qmax) bounds it (a Python float: numpy's float16 max times qmax would overflow to inf)."""
    codec = spec.hidden_codec
    return FP16_MAX * (1.0 if getattr(codec.config, "outliers", 0) else codec.qmax)


def _mass_record(mass: np.ndarray) -> dict[str, float]:
    """How much probability a shard's top-k keep: mean, 5th percentile and minimum over its tokens."""
    if not mass.size:
        return {}
    return {"kept_mass_mean": float(mass.mean()), "kept_mass_p5": float(np.percentile(mass, 5)),
            "kept_mass_min": float(mass.min())}


def _gaps(array: CachedArray, rows: np.ndarray) -> np.ndarray:
    """Rows non-decreasing along k, stored as gaps (``layout.to_gaps``); a row that decreases is refused."""
    gaps = to_gaps(rows.astype(np.int64))
    if rows.size and not (gaps[:, 1:] >= 0).all():
        what = "log-probs must be sorted descending" if array.logit and array.logit.logprob else \
            "ids must be non-decreasing (distinct ids in order, unused slots repeating the last)"
        raise InvalidSequenceError(f"{array.name}: each token's {what}")
    return gaps.astype(rows.dtype)


def _logprobs(spec: CacheSpec, name: str, flat: np.ndarray, lossy: dict[str, dict[str, float]]) -> np.ndarray:
    """Top-k log-probabilities ``[T, k]`` (float, <= 0) as uint16 multiples of ``spec.logprob_step``, with the
    largest error recorded; those below ``-65535 * step`` (far under any top-k's tail) are clipped and counted."""
    values, step = flat.astype(np.float32), spec.logprob_step
    if values.size and not (values.max() <= step / 2 and not np.isnan(values).any()):
        raise InvalidSequenceError(f"{name}: expected log-probabilities (<= 0) for topk_values logprob, got values "
                                   f"up to {np.nanmax(values) if not np.isnan(values).all() else 'nan'}")
    q = np.minimum(np.rint(-values / step), 65535)
    error = np.abs(q * -step - values)
    clipped = q == 65535
    lossy[name] = {"step": step, "max_abs_error": float(error[~clipped].max(initial=0.0)),
                   "clipped": int(clipped.sum())}
    codes: np.ndarray = q.astype(np.uint16)
    return codes


def _documents(spec: CacheSpec, sequences: Sequence[Mapping[str, Any]]) -> dict[str, list[list[int]]]:
    """Per stream, each sequence's document lengths when rows keep documents apart (from that stream's own
    positions, as the reader takes them); empty otherwise."""
    if ArrayKind.POSITION_IDS not in spec.token_arrays:
        return {}
    return {stream: [document_lengths(np.asarray(item[prefixed(stream, "position_ids")])) for item in sequences]
            for stream in spec.streams}


def _stream_documents(array: CachedArray, documents: dict[str, list[list[int]]]) -> list[list[int]] | None:
    """The document lengths attention ``array`` is stored by: its query stream's, if stored per document."""
    geometry = array.geometry
    return documents[geometry.queries] if geometry is not None and geometry.by_documents else None


def _all_offsets(spec: CacheSpec, lengths: list[dict[str, int]],
                 documents: dict[str, list[list[int]]]) -> dict[str, np.ndarray]:
    """Every offsets array of the shard: token offsets per stream, then rows of each attention geometry."""
    arrays = {name: np.zeros(0) for name in spec.offset_arrays()}
    for stream in spec.streams:
        arrays[spec.offsets_name(spec.ids_name(stream))] = _offsets([n[stream] for n in lengths])
    for array in spec.arrays():
        if array.geometry is not None:
            queries, keys, triangle = array.geometry.queries, array.geometry.keys, array.geometry.triangle
            docs = _stream_documents(array, documents)
            rows = [attention_rows(n[queries], triangle, n[keys], docs[i] if docs else None)
                    for i, n in enumerate(lengths)]
            arrays[array.offsets] = _offsets(rows)
    return arrays


def _encode_array(spec: CacheSpec, array: CachedArray, parts: list[np.ndarray], lossy: dict[str, dict[str, float]],
                  documents: list[list[int]] | None = None, *, finite: bool = False,
                  concatenate: Concatenate = np.concatenate) -> np.ndarray:
    """Concatenate one array over the shard's sequences and give it its storage dtype."""
    name = array.name
    if array.geometry is not None:
        num_heads = {p.shape[0] for p in parts}
        heads = spec.attention_heads
        if heads is not None and num_heads == {len(heads)}:
            # Already cut to the spec's heads by the caller (on its device, saving the host copy). Heads are
            # sorted and unique, so when they number H they are 0..H-1 and selecting again changes nothing.
            heads = None
        if len(num_heads) != 1 or (heads and max(heads) >= min(num_heads)):
            raise InvalidSequenceError(f"{name}: head counts {sorted(num_heads)} differ between sequences or "
                                       f"do not cover attention_heads {list(heads or [])}")
        triangle = array.geometry.triangle
        parts = [pack_attention(p, heads, triangle, documents[i] if documents else None) for i, p in enumerate(parts)]
    elif array.token_rows and len({p.shape[1] for p in parts}) != 1:
        raise InvalidSequenceError(f"{name}: widths {sorted({p.shape[1] for p in parts})} differ between "
                                   f"sequences; expected one width per layer")
    flat = concatenate(parts)
    if array.kind in TOKEN_KINDS:
        return _integer_tokens(array, flat)
    if array.exact:
        return _exact_logits(spec, array, flat, lossy)
    if array.coded or array.part is not None:
        return _coded_array(spec, array, flat)
    return _float_target(spec, name, flat, lossy, finite)


def _exact_logits(spec: CacheSpec, array: CachedArray, flat: np.ndarray,
                  lossy: dict[str, dict[str, float]]) -> np.ndarray:
    """A logit array of a fixed type, as its layout records it: log-probs quantised, vocabulary ids as given
    (range-checked and narrowed once the whole shard is known), integers range-checked, floats in their dtype."""
    if array.logit is not None and array.logit.logprob:
        return _logprobs(spec, array.name, flat, lossy)
    if array.vocab_ids:
        return flat
    return _integer_tokens(array, flat) if array.dtype.kind in "iu" else flat.astype(array.dtype)


def _coded_array(spec: CacheSpec, array: CachedArray, flat: np.ndarray) -> np.ndarray:
    """Codes and their companions, as given (made by a codec), in their storage dtype."""
    name, dtype = array.name, array.dtype
    if flat.dtype.kind != dtype.kind or flat.dtype.itemsize != dtype.itemsize:
        raise InvalidSequenceError(f"{name}: expected {dtype} from the {spec.hidden_codec.name} codec, got "
                                   f"{flat.dtype}")
    return flat.view(dtype)
