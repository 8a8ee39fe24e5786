"""Stage two: train a student from cached teacher targets, teacher-free.

This is stage two's front door: ``pipeline`` imports from ``kdcache.stages.train`` only, never from its modules
(``tests/test_source_rules.py`` reads the source to keep it so). Its folders are floors, each importing only
those below it: ``core`` (options, layer maps, the student, masks, and the plan with its checks), ``losses`` (every
loss by name), ``objective`` (the run's loss over its streams: ``compound``, ``distill``), ``cross`` (a student with
its own tokenizer) and ``evaluation`` (scores against a cache), with ``feed`` (the cache into the device) beside
them. This package's own modules are the top floor: the loop (``loop``, ``engine``, ``checkpoint``...) and the
Python API it is built on (``api``: ``DistillationLoss``, ``CacheDataset``; ``hf_trainer``: ``CacheTrainer``;
``hf_args``: ``DistillationArguments``).
Names load on first use (``kdcache.lazy_exports``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.api import (
        ApiError as ApiError,
        CacheDataset as CacheDataset,
        DistillationLoss as DistillationLoss,
    )
    from kdcache.stages.train.checkpoint import has_checkpoint as has_checkpoint
    from kdcache.stages.train.core import (
        DEFAULT_TEMPERATURE as DEFAULT_TEMPERATURE,
        TrainOptions as TrainOptions,
        open_cache as open_cache,
        text_problems as text_problems,
    )
    from kdcache.stages.train.evaluation import (
        EvaluationError as EvaluationError,
        alignment_panels as alignment_panels,
        cache_identity as cache_identity,
        cache_label as cache_label,
        eval_path as eval_path,
        evaluate_cross_run as evaluate_cross_run,
        evaluate_run as evaluate_run,
        find_eval as find_eval,
        is_cross_run as is_cross_run,
        newest as newest,
        read_evals as read_evals,
        remove_evals as remove_evals,
        student_folder_problems as student_folder_problems,
        trained_student as trained_student,
    )
    from kdcache.stages.train.feed import DataPosition as DataPosition
    from kdcache.stages.train.hf_args import DistillationArguments as DistillationArguments
    from kdcache.stages.train.hf_trainer import CacheTrainer as CacheTrainer
    from kdcache.stages.train.init_student import init_student_from_teacher as init_student_from_teacher
    from kdcache.stages.train.interrupt import TrainingInterrupted as TrainingInterrupted
    from kdcache.stages.train.logging import read_jsonl as read_jsonl, read_records as read_records
    from kdcache.stages.train.loop import run_training as run_training
    from kdcache.stages.train.optimizer_step import TrainStep as TrainStep
    from kdcache.stages.train.run_identity import trained_on as trained_on
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
