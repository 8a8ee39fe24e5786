"""A teacher larger than one device (``--teacher-parallel``): the layouts and the grid of ranks they make
(``layouts``), the memory each rank needs (``memory``), the runner's side (``parallel_run``), the collectives
(``distributed``) and top-k logits from a split LM head (``sharded_head``). Imported through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.parallel.distributed import DistContext as DistContext
    from kdcache.stages.precompute.parallel.layouts import (
        Grid as Grid,
        Layout as Layout,
        load_kwargs as load_kwargs,
        no_autograd as no_autograd,
        settle as settle,
    )
    from kdcache.stages.precompute.parallel.parallel_run import (
        check_parallel as check_parallel,
        group_todo as group_todo,
        lend_share as lend_share,
        memory_only as memory_only,
    )
    from kdcache.stages.precompute.parallel.sharded_head import chunked_head as chunked_head

__getattr__, __dir__, __all__ = attach(__name__, __file__)
