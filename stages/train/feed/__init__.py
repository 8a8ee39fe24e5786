"""Stage two's feed: the cache streamed in a deterministic, resumable order (``streaming``), the shards a micro-batch
needs decoded ahead and released after (``decode_plan``), and micro-batches copied to the device one step ahead
(``device_feed``).

No front door: import each name from the module that defines it.
"""
