"""A teacher larger than one device (``--teacher-parallel``): the layouts and the grid of ranks they make
(``layouts``), the memory each rank needs (``memory``), the runner's side (``parallel_run``) and the collectives
(``distributed``). Above ``core`` and ``rows``, below ``capture`` (whose ``sharded_head`` takes top-k logits from
a split LM head). Imported through this door.
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
        check_tensor_plan as check_tensor_plan,
        group_todo as group_todo,
        lend_share as lend_share,
        memory_only as memory_only,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
