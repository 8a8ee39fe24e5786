"""int8: one signed byte per value, -127..127, one scale per row."""

from __future__ import annotations

from kdcache.storage.hidden_codecs.arrays import Array, namespace
from kdcache.storage.hidden_codecs.base import register
from kdcache.storage.hidden_codecs.quantised import QuantisedCodec


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
