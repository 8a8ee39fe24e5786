"""What a cache holds, as one JSON-ready dict: ``kdcache inspect`` prints it, ``kdcache report`` reads it.

A module of its own, below the commands, so that ``pipeline.report`` need not import a command module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kdcache import stages, storage

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec


def _ratio(decoded: int, stored: int) -> float | None:
    return round(decoded / stored, 3) if stored else None


def _against_fp16(spec: CacheSpec, arrays: dict[str, dict[str, Any]], tokens: int) -> None:
    """Give each coded hidden array ``fp16_ratio``: the fp16 bytes of the values it stands for over the stored bytes
    of its codes and companions (scales, outliers). Its own ``compression_ratio`` compares the codes with their
    int8 bytes only (int7's 1.26 is 2.2x against fp16). Projected (rank < d) codecs are left out: their fp16
    width is not the codes'."""
    codec = spec.hidden_codec
    if codec.float_dtype or (codec.rank and not codec.full_rank):
        return
    for name, info in arrays.items():
        if not spec.coded(name) or not tokens:
            continue
        width = int(info["shape_tail"][-1]) * codec.per_code
        stored = sum(arrays[part]["stored_bytes"] for part in spec.with_parts(name) if part in arrays)
        info["fp16_ratio"] = _ratio(2 * width * tokens, stored)


def describe(path: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as a JSON-ready dict (``num_tokens`` is a plain integer).

    Raises:
        KdcacheError: missing or corrupt manifest, newer format version.
    """
    reader = storage.CacheReader(path, allow_partial=True)
    spec, manifest = reader.spec, reader.manifest
    tokens = reader.num_tokens
    records = reader.records  # for a partial cache: what is committed so far
    arrays = storage.summarize_arrays(spec, records)
    for info in arrays.values():
        info["bytes_per_token"] = round(info["stored_bytes"] / tokens, 2) if tokens else None
        info["decoded_bytes_per_token"] = round(info["decoded_bytes"] / tokens, 2) if tokens else None
        info["compression_ratio"] = _ratio(info["decoded_bytes"], info["stored_bytes"])
        info["codec_label"] = storage.describe_codec(info["codec"])
    _against_fp16(spec, arrays, tokens)
    stored = sum(r.stored_bytes for r in records)
    decoded = sum(r.decoded_bytes for r in records)
    return {
        "path": str(path), "status": manifest.status, "format_version": manifest.format_version,
        "backend": spec.backend, "features": list(spec.features), "hidden_layers": list(spec.hidden_layers),
        "attention_layers": list(spec.attention_layers), "layout": "seq2seq" if spec.is_encoder_decoder else "single",
        "streams": {stream or "tokens": {"hidden_layers": list(hidden), "attention_layers": list(attention)}
                    for stream, hidden, attention in spec.stream_layers()},
        "cross_attention_layers": list(spec.layers_of("cross_attention", "decoder")),
        "attention_heads": None if spec.attention_heads is None else list(spec.attention_heads),
        "attention_triangle": spec.attention_triangle, "attention_source": spec.attention_source,
        "attention_scores": spec.attention_scores, "logits": spec.logits, "top_k": spec.top_k,
        "samples": spec.samples, "sample_temperature": spec.sample_temperature,
        "vocab_size": spec.vocab_size, "dtype": spec.dtype, "bitround": spec.bitround,
        "hidden_codec": spec.hidden_codec.record(), "hidden_codec_text": spec.hidden_codec.describe(),
        "codecs": {"activations": spec.codec, "topk": spec.topk_codec},
        "num_sequences": spec.num_sequences, "num_committed_sequences": sum(r.seq_stop - r.seq_start for r in records),
        "num_tokens": int(tokens), "num_shards": spec.num_shards, "num_committed_shards": len(records),
        "stored_bytes": stored, "decoded_bytes": decoded,
        "bytes_per_token": round(stored / tokens, 2) if tokens else None,
        "compression_ratio": _ratio(decoded, stored), "arrays": arrays, "fingerprints": reader.fingerprints,
        "created_at": manifest.created_at, "updated_at": manifest.updated_at, "texts": stages.has_texts(reader.store),
    }
