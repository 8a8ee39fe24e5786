"""A teacher larger than one device (``--teacher-parallel``): the layouts and the grid of ranks they make
(``layouts``), the memory each rank needs (``memory``), the runner's side (``parallel_run``) and the collectives
(``distributed``). Above ``core`` and ``rows``, below ``capture`` (whose ``sharded_head`` takes top-k logits from a
split LM head).

No front door: import each name from the module that defines it.
"""
