"""int7: 7-bit codes (-63..63) in int8 bytes, one scale per row.

zstd's entropy coding stores them in ~6.4 bits (2.2x smaller than fp16 on MiniLM, benchmarks/RESULTS.md) at
twice int8's error, still well inside 0.1% of every hidden loss.
"""

from __future__ import annotations

from kdcache.storage.hidden_codecs.base import register
from kdcache.storage.hidden_codecs.int8 import Int8


@register
class Int7(Int8):
    name = "int7"
    help = "7-bit codes in int8 bytes (about 6.4 bits after zstd)"
    order = 4
    qmax = 63.0
