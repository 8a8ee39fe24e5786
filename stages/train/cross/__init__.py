"""A student with its own tokenizer (``--cross-tokenizer``): the alignment of two tokenizations by the text they cover
(``align``) and the model that trains across them (``cross_model``), which wraps the run's loss (``objective``).
What such a run needs of its cache is checked with the plan, on the ground floor (``core.checks``).

No front door: import each name from the module that defines it.
"""
