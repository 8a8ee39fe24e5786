"""fp16: hidden states stored as float16, as before codecs existed (the default with ``--dtype fp16``)."""

from __future__ import annotations

from kdcache.storage.hidden_codecs.base import HiddenCodec, register


@register
class Fp16(HiddenCodec):
    name = "fp16"
    help = "float16 (the default with --dtype fp16)"
    order = 0
    float_dtype = "fp16"
