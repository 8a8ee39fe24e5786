"""Stage one's rows: the dataset loaded and tokenized (``data``, ``chat``), built once per cache in parallel
(``row_build``) and kept as a memory-mapped file (``row_store``), packed or truncated (``packing``), and planned
into length-bucketed batches shard by shard (``batching``). The rest of stage one imports it through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.rows.batching import (
        Partition as Partition,
        collate as collate,
        plan_batches as plan_batches,
    )
    from kdcache.stages.precompute.rows.chat import (
        check_conversation as check_conversation,
        render as render,
    )
    from kdcache.stages.precompute.rows.data import (
        TokenStreams as TokenStreams,
        load_texts as load_texts,
        text_template as text_template,
    )
    from kdcache.stages.precompute.rows.row_build import pair_streams as pair_streams, text_streams as text_streams
    from kdcache.stages.precompute.rows.row_store import row_problems as row_problems
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
