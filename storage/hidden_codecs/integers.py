"""The integer codes.

- int4: two 4-bit codes per byte, one scale per ``group`` channels. Codes ``[T, d/2]`` uint8: the even channel in
  the low nibble, each stored as ``q + 8`` (q in -7..7).
- int8: one signed byte per value, -127..127, one scale per row; int7: the same bytes holding -63..63.
"""

from __future__ import annotations

from kdcache.storage.hidden_codecs.arrays import Array, namespace
from kdcache.storage.hidden_codecs.base import register
from kdcache.storage.hidden_codecs.quantised import MAX_WIDTH, QuantisedCodec


@register
class Int4(QuantisedCodec):
    name = "int4"
    help = "two 4-bit codes per byte, one scale per group of channels"
    order = 5
    code_dtype = "uint8"
    qmax = 7.0
    per_code = 2

    def group_count(self, d: int) -> int:
        """One scale per ``group`` channels (the whole row when d <= group)."""
        return d // min(self.config.group, d)

    def unused_keys(self) -> frozenset[str]:
        return frozenset()

    def width_expectation(self, d: int) -> str | None:
        group = min(self.config.group, d)
        return f"d <= {MAX_WIDTH} and divisible by its group {group}" if d % group or d > MAX_WIDTH else None

    def to_codes(self, scaled: Array) -> Array:
        xp = namespace(scaled)
        nibbles = xp.reshape(xp.astype(xp.round(scaled) + 8, xp.uint8), (scaled.shape[0], -1, 2))
        return nibbles[..., 0] | (nibbles[..., 1] << 4)

    def from_codes(self, codes: Array) -> Array:
        xp = namespace(codes)
        nibbles = xp.reshape(xp.stack([codes & 15, codes >> 4], axis=-1), (codes.shape[0], -1))
        return xp.astype(nibbles, xp.float32) - 8


@register
class Int8(QuantisedCodec):
    name = "int8"
    help = "int8 codes, one scale per row (quantised on the teacher's device)"
    order = 3
    code_dtype = "int8"
    qmax = 127.0

    def to_codes(self, scaled: Array) -> Array:
        xp = namespace(scaled)
        return xp.astype(xp.round(scaled), xp.int8)  # round half to even, as numpy's rint and torch's round

    def from_codes(self, codes: Array) -> Array:
        xp = namespace(codes)
        return xp.astype(codes, xp.float32)


@register
class Int7(Int8):
    """7-bit codes: zstd's entropy coding stores them in ~6.4 bits (2.2x smaller than fp16 on MiniLM,
    benchmarks/RESULTS.md) at twice int8's error, still well inside 0.1% of every hidden loss."""

    name = "int7"
    help = "7-bit codes in int8 bytes (about 6.4 bits after zstd)"
    order = 4
    qmax = 63.0
