"""What the teacher's forward keeps: hooks on the selected layers (``features``, and ``qk_capture`` for
queries and keys), logits through the LM head in chunks (``logit_head``, and ``sharded_head`` for a head split
across ranks), and the device-to-host transfer that never makes the forward wait (``transfer``). The top floor of
stage one's sub-packages, above ``core``, ``rows`` and ``parallel``; the rest of stage one imports it through this
door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.capture.compiled import say_compile_cost as say_compile_cost
    from kdcache.stages.precompute.capture.features import (
        FeatureCapture as FeatureCapture,
        check_ranges as check_ranges,
        finish as finish,
        fp16_bounded as fp16_bounded,
        hidden_targets as hidden_targets,
        max_abs as max_abs,
        to_numpy as to_numpy,
        to_storage_dtype as to_storage_dtype,
    )
    from kdcache.stages.precompute.capture.logit_head import ChunkedHead as ChunkedHead, logit_targets as logit_targets
    from kdcache.stages.precompute.capture.qk_capture import (
        QKCapture as QKCapture,
        with_score_rules as with_score_rules,
    )
    from kdcache.stages.precompute.capture.sharded_head import chunked_head as chunked_head
    from kdcache.stages.precompute.capture.transfer import ShardItems as ShardItems, cut_padding as cut_padding
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
