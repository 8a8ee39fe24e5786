"""Stage two's ground floor: what every part of it reads and nothing of it below: the options (``options``), the layer
maps (``layer_maps``), the student and its facts (``student``, ``student_head``), which tokens each term counts
(``masks``), and the plan they resolve to against the cache (``plan``, with its checks, a ``--cross-tokenizer``
run's too: ``checks``), which raises ``CacheCheckError``.

No front door: import each name from the module that defines it.
"""
