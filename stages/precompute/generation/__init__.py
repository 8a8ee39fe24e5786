"""Generation with capture (issue 58): the teacher writes its own responses and its targets along them are kept while
it writes, so it runs once. A floor above ``capture`` (it reads ``core``, ``rows`` and ``capture``): ``options``
(the ``generate`` group and ``GenerateOptions``), ``prompts`` (the dataset into prompt ids), ``sampling``
(counter-based draws that depend only on the seed, the prompt, the response number and the step), ``decode`` (the
decode loop with a KV cache that keeps the targets of the prefill and of each new token) and ``packed`` (``--packing
documents``: the finished responses packed into rows without running the teacher again). The command itself, which
commits the shards, is ``stages.precompute.generate``.

No front door: import each name from the module that defines it.
"""
