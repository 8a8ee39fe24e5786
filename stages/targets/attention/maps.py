"""``--attention-source maps``: each block's ``[H', L, L]`` probabilities, hooked from the teacher's eager
attention and compared with the student's maps. Every default of ``base.AttentionSource`` is this source's."""

from __future__ import annotations

from kdcache.stages.targets.attention.base import AttentionSource, register
from kdcache.storage import MAPS_LAYOUT


@register
class Maps(AttentionSource):
    layout = MAPS_LAYOUT
    summary = "each block's [H, L, L] probabilities (H x L values per token)"
