"""fp8: float8 e4m3fn bit patterns in uint8, one scale per row (values scaled to within +-448 first, so that the
rounding never makes NaN)."""

from __future__ import annotations

from kdcache.storage.hidden_codecs.arrays import FP8_MAX, Array, namespace, ops_for
from kdcache.storage.hidden_codecs.base import register
from kdcache.storage.hidden_codecs.quantised import QuantisedCodec


@register
class Fp8(QuantisedCodec):
    name = "fp8"
    help = "float8 e4m3 bit patterns, one scale per row"
    order = 2
    code_dtype = "uint8"
    qmax = FP8_MAX

    def to_codes(self, scaled: Array) -> Array:
        return ops_for(namespace(scaled)).fp8_bits(scaled)

    def from_codes(self, codes: Array) -> Array:
        return ops_for(namespace(codes)).fp8_values(codes)
