"""Evaluation against a cache, no teacher in memory: agreement metrics (``agreement``,
``attention_agreement``), a run's evaluation (``evaluate``), a held-out cache scored while a student trains
(``heldout``), the span metrics of a student with its own tokenizer (``span_eval``) and where the records live
(``eval_records``). The rest of the code imports it through this door.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.evaluation.eval_records import (
        alignment_panels as alignment_panels,
        cache_identity as cache_identity,
        cache_label as cache_label,
        eval_path as eval_path,
        find_eval as find_eval,
        newest as newest,
        read_evals as read_evals,
        remove_evals as remove_evals,
    )
    from kdcache.stages.train.evaluation.evaluate import (
        EvaluationError as EvaluationError,
        evaluate_run as evaluate_run,
        student_folder_problems as student_folder_problems,
        trained_student as trained_student,
    )
    from kdcache.stages.train.evaluation.heldout import (
        HeldOut as HeldOut,
        heldout_problems as heldout_problems,
        lm_kind as lm_kind,
    )
    from kdcache.stages.train.evaluation.span_eval import (
        evaluate_cross_run as evaluate_cross_run,
        evaluate_spans as evaluate_spans,
        is_cross_run as is_cross_run,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
