"""Stage two's objective: the loss of a run and the student's forward under it, above ``losses`` (the terms by name)
and ``core`` (options, maps, masks, plan): one stream's weighted terms and their projectors (``compound``,
``projectors``), the loss over every stream of the cache with the model DeepSpeed trains (``distill``), and the
student's forward with its queries and keys recorded for a q/k cache (``recording``), which evaluation runs too, and
each term's share of its optimizer step across micro-batches and ranks (``step_norm``).

No front door: import each name from the module that defines it.
"""
