"""A student with its own tokenizer (``--cross-tokenizer``): the alignment of two tokenizations by the
text they cover (``align``) and the model that trains across them (``cross_model``), which wraps the run's loss
(``objective``). What such a run needs of its cache is checked with the plan, on the ground floor
(``core.cross_checks``). The rest of the code imports it through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.cross.cross_model import (
        SIDE_KEYS as SIDE_KEYS,
        SpanAligner as SpanAligner,
        build_cross_model as build_cross_model,
        cache_tokenizer as cache_tokenizer,
        without_logit_kl as without_logit_kl,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
