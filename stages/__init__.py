"""The two stages: precompute (stage one) and train (stage two). Neither imports the other.

This is the stages' one front door, for ``pipeline``: the names its commands call by attribute
(``stages.run_training(...)``), each loaded on first use (``kdcache.lazy_exports``), so that building the command
line imports neither torch nor transformers. Everything else is imported from the module that defines it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.common.cache_texts import has_texts as has_texts
    from kdcache.stages.draft.evaluation import (
        EvalOptions as EvalOptions,
        evaluate_drafts as evaluate_drafts,
        format_report as format_report,
    )
    from kdcache.stages.draft.training import DraftOptions as DraftOptions, run_draft as run_draft
    from kdcache.stages.precompute.core.progress import format_summary as format_summary, reused_cache as reused_cache
    from kdcache.stages.precompute.estimate import format_estimate as format_estimate
    from kdcache.stages.precompute.generate import (
        format_generate_estimate as format_generate_estimate,
        run_generate as run_generate,
    )
    from kdcache.stages.precompute.rows.row_store import row_problems as row_problems
    from kdcache.stages.precompute.runner import merge_cache as merge_cache, run_precompute as run_precompute
    from kdcache.stages.train.checkpoint import has_checkpoint as has_checkpoint, trained_on as trained_on
    from kdcache.stages.train.core.checks import open_cache as open_cache, text_problems as text_problems
    from kdcache.stages.train.evaluation.eval_records import (
        alignment_panels as alignment_panels,
        cache_identity as cache_identity,
        cache_label as cache_label,
        eval_path as eval_path,
        find_eval as find_eval,
        newest as newest,
        read_evals as read_evals,
    )
    from kdcache.stages.train.evaluation.evaluate import (
        EvaluationError as EvaluationError,
        evaluate_run as evaluate_run,
        student_folder_problems as student_folder_problems,
        trained_student as trained_student,
    )
    from kdcache.stages.train.evaluation.span_eval import (
        evaluate_cross_run as evaluate_cross_run,
        is_cross_run as is_cross_run,
    )
    from kdcache.stages.train.init_student import init_student_from_teacher as init_student_from_teacher
    from kdcache.stages.train.logging import read_jsonl as read_jsonl, read_records as read_records
    from kdcache.stages.train.loop import run_training as run_training
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
