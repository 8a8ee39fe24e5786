"""Stage two's objective, above ``losses`` (the terms by name) and ``core`` (options, maps, masks, plan): one
stream's weighted terms and their projectors (``compound``), the student's side of the run's loss
(``distill``: its forward arguments, one stream's view of its outputs, the packed-documents check, its forward
with its queries and keys recorded for a q/k cache, which evaluation runs too), and each term's
share of its optimizer step across micro-batches and ranks (``step_norm``). The run's loss itself, built from
these, is ``train.loss.DistillationLoss``.

No front door: import each name from the module that defines it.
"""
