"""Stage two's feed: the cache streamed in a deterministic, resumable order (``streaming``), the shards a
micro-batch needs decoded ahead and released after (``decode_plan``), and micro-batches copied to the device one
step ahead (``device_feed``). The rest of stage two imports it through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.feed.ahead import PREFETCH_MIB as PREFETCH_MIB
    from kdcache.stages.train.feed.device_feed import Batch as Batch, DeviceFeed as DeviceFeed
    from kdcache.stages.train.feed.streaming import (
        BatchExtension as BatchExtension,
        CacheStream as CacheStream,
        DataPosition as DataPosition,
        check_resumable as check_resumable,
        collate as collate,
        next_position as next_position,
        to_device as to_device,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
