"""bf16: hidden states stored as bfloat16 (the default with ``--dtype bf16``)."""

from __future__ import annotations

from kdcache.storage.hidden_codecs.base import HiddenCodec, register


@register
class Bf16(HiddenCodec):
    name = "bf16"
    help = "bfloat16 (the default with --dtype bf16)"
    order = 1
    float_dtype = "bf16"
