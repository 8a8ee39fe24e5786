"""Model-facing helpers that both stages share (no teacher loading here).

The front door for ``pipeline``: it imports ``kdcache.stages.common`` and the registries beneath it
(``attention_sources``, ``logit_kinds``), never another of its modules. Names load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.common.cache_texts import has_texts as has_texts
    from kdcache.stages.common.option_groups import (
        flatten as flatten,
        groups as groups,
        leaves as leaves,
        nest as nest,
        required as required,
    )
    from kdcache.stages.common.stream_options import (
        ALIASES as ALIASES,
        StreamLayers as StreamLayers,
        alias_flags as alias_flags,
        fold_aliases as fold_aliases,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
