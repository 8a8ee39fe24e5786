"""A student with its own tokenizer (``--cross-tokenizer``): the alignment of two tokenizations by the
text they cover (``align``), the model that trains across them (``cross_model``) and what such a run needs of its
cache (``cross_checks``). The rest of the code imports it through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.cross.cross_checks import (
        cross_hint as cross_hint,
        cross_problems as cross_problems,
        text_problems as text_problems,
    )
    from kdcache.stages.train.cross.cross_model import (
        SIDE_KEYS as SIDE_KEYS,
        SpanAligner as SpanAligner,
        build_cross_model as build_cross_model,
        cache_tokenizer as cache_tokenizer,
        without_logit_kl as without_logit_kl,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
