"""Codec resolution: numcodecs names or config dicts, mapped onto what each backend can store.

A cache records every codec as a numcodecs configuration dict (``{"id": "blosc", "cname": "lz4", ...}``), so
the choice is reproducible and readable. The zarr backend turns that dict into zarr v3 codecs (native Blosc,
Zstd and Gzip where they exist, so plain zarr reads the data: ``zarr_backend.to_zarr_compressors``, beside zarr
itself); the Arrow backend maps it to IPC buffer compression, which only knows LZ4 frame and ZSTD.
"""

from __future__ import annotations

from typing import Any, Literal, TypeAlias

import numcodecs

from kdcache.storage.core.errors import UnknownCodecError

BITSHUFFLE = 2
CompressorConfig: TypeAlias = dict[str, Any]  # a compressor as numcodecs configures it: {"id": ..., its parameters}
# Defaults measured in shared/DESIGN.md: lz4 matches zstd's ratio on fp16 activations at ~2.5x the speed;
# sorted top-k values compress much better, so they get zstd.
DEFAULT_CODEC: dict[str, Any] = {"id": "blosc", "cname": "lz4", "clevel": 5, "shuffle": BITSHUFFLE, "blocksize": 0}
DEFAULT_TOPK_CODEC: dict[str, Any] = {"id": "blosc", "cname": "zstd", "clevel": 5, "shuffle": BITSHUFFLE,
                                      "blocksize": 0}
ARROW_DEFAULT_CODEC: dict[str, Any] = {"id": "zstd", "level": 3}
ALIASES: dict[str, dict[str, Any]] = {"blosc-lz4": DEFAULT_CODEC, "blosc-zstd": DEFAULT_TOPK_CODEC}
SHUFFLE_NAMES: dict[int, Literal["noshuffle", "shuffle", "bitshuffle"]] = {0: "noshuffle", 1: "shuffle",
                                                                           2: "bitshuffle"}


def resolve_codec(codec: str | dict[str, Any] | numcodecs.abc.Codec | None) -> dict[str, Any]:
    """Normalise a codec given by name, config dict or numcodecs object to its full numcodecs config.

    Args:
        codec: e.g. "zstd", "blosc-lz4", ``{"id": "zstd", "level": 3}``, ``numcodecs.Zstd(3)``; None = default.

    Raises:
        UnknownCodecError: the name is not a numcodecs codec (the message lists the known ones), or the
            configuration is rejected by the codec.
    """
    if codec is None:
        return dict(DEFAULT_CODEC)
    if isinstance(codec, numcodecs.abc.Codec):
        return dict(codec.get_config())
    config = dict(ALIASES.get(codec, {"id": codec})) if isinstance(codec, str) else dict(codec)
    name = config.get("id")
    if name not in numcodecs.registry.codec_registry:
        known = sorted(set(numcodecs.registry.codec_registry) | set(ALIASES))
        raise UnknownCodecError(f"unknown codec {name!r}; known codecs: {', '.join(known)}")
    try:
        return dict(numcodecs.get_codec(config).get_config())
    except (TypeError, ValueError) as exc:
        raise UnknownCodecError(f"codec {name!r} rejects configuration {config}: {exc}") from exc


def describe_codec(config: dict[str, Any]) -> str:
    """A short human label, e.g. ``blosc(lz4, bitshuffle, clevel 5)``."""
    if config.get("id") == "blosc":
        shuffle = SHUFFLE_NAMES.get(config.get("shuffle", -1), "autoshuffle")
        return f"blosc({config.get('cname')}, {shuffle}, clevel {config.get('clevel')})"
    extras = ", ".join(f"{k} {v}" for k, v in sorted(config.items()) if k != "id")
    return f"{config.get('id')}({extras})" if extras else str(config.get("id"))


def to_arrow_compression(config: dict[str, Any]) -> tuple[str, int | None]:
    """Arrow IPC buffer compression ``(codec, level)`` for a numcodecs config.

    Raises:
        UnknownCodecError: the codec has no Arrow IPC equivalent (only lz4 and zstd families do).
    """
    name = config["id"]
    family = config.get("cname") if name == "blosc" else name
    if family in ("lz4", "lz4hc"):
        return "lz4", None
    if family == "zstd":
        return "zstd", config.get("clevel", config.get("level"))
    raise UnknownCodecError(f"codec {describe_codec(config)} has no Arrow IPC equivalent; the arrow backend "
                            f"supports lz4- and zstd-family codecs (lz4, zstd, blosc-lz4, blosc-zstd)")
