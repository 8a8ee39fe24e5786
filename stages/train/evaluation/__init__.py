"""Evaluation against a cache, no teacher in memory: agreement metrics (``agreement``), a run's evaluation with its
attention agreement (``evaluate``), a held-out cache scored while a student trains (``heldout``), the span metrics
of a student with its own tokenizer (``span_eval``) and where the records live (``eval_records``).

No front door: import each name from the module that defines it.
"""
