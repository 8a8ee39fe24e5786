"""``--attention-source qkv``: ``qk`` plus each block's values (``H_kv x head_dim`` per token), which the relation
loss reads; the KL reads the queries and keys alone."""

from __future__ import annotations

from kdcache.stages.targets.attention.base import register
from kdcache.stages.targets.attention.qk import QK
from kdcache.storage import QKV_LAYOUT


@register
class QKV(QK):
    layout = QKV_LAYOUT
    summary = "also the values, for the relation loss"
