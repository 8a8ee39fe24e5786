"""The float codecs: hidden states stored as float16 or bfloat16, as before codecs existed (each the default with
its ``--dtype``)."""

from __future__ import annotations

from kdcache.storage.hidden_codecs.base import HiddenCodec, register


@register
class Bf16(HiddenCodec):
    name = "bf16"
    help = "bfloat16 (the default with --dtype bf16)"
    order = 1
    float_dtype = "bf16"


@register
class Fp16(HiddenCodec):
    name = "fp16"
    help = "float16 (the default with --dtype fp16)"
    order = 0
    float_dtype = "fp16"
