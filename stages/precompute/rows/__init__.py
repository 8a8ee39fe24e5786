"""Stage one's rows: the dataset loaded and tokenized (``data``, ``chat``), built once per cache in parallel
(``row_build``) and kept as a memory-mapped file (``row_store``), packed or truncated (``packing``), and planned
into length-bucketed batches shard by shard (``batching``).

No front door: import each name from the module that defines it.
"""
