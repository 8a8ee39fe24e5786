"""Stage two's objective: the loss of a run and the student's forward under it, above ``losses`` (the terms by
name) and ``core`` (options, maps, masks, plan): one stream's weighted terms and their projectors (``compound``,
``projectors``), the loss over every stream of the cache with the model DeepSpeed trains (``distill``), and the
student's forward with its queries and keys recorded for a q/k cache (``recording``), which evaluation runs too,
and each term's share of its optimizer step across micro-batches and ranks (``step_norm``).

``cross`` (a student with its own tokenizer wraps this loss), ``evaluation`` and the loop import it through this
door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.objective.distill import (
        DistillLoss as DistillLoss,
        DistillModel as DistillModel,
        StudentRunner as StudentRunner,
        build_criterion as build_criterion,
        check_documents_apart as check_documents_apart,
        has_vocab_term as has_vocab_term,
        student_inputs as student_inputs,
        student_view as student_view,
        unwrapped_student as unwrapped_student,
    )
    from kdcache.stages.train.objective.recording import StudentOutputs as StudentOutputs, recorded as recorded
    from kdcache.stages.train.objective.step_norm import (
        STEP_COUNTS as STEP_COUNTS,
        Counts as Counts,
        StepCounts as StepCounts,
        term_counts as term_counts,
        with_step_counts as with_step_counts,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
