"""The student's forward with its queries and keys recorded, for a q/k cache (``--attention-source qk``/``qkv``).

Training (``train.loss.DistillationLoss.student_outputs``) and evaluation (``evaluation.attention_agreement``) run
the student through the same ``recorded``, so both compare the same rebuilt attention with the cache; it lives on
this floor, below evaluation, so that training need not import evaluation for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kdcache.stages.targets.attention.qk_attention import QKRecorder, QKRecorderError
from kdcache.stages.train.losses import LossError
from kdcache.stages.train.objective.compound import StudentOutput

Outputs = TypeVar("Outputs", bound=StudentOutput)


def recorded(recorder: QKRecorder, run: Callable[[], Outputs]) -> Outputs:
    """``run()`` (the student's forward) under ``recorder``, its outputs given ``attention_qkv`` (block -> the
    recorded queries, keys and values).

    Raises:
        LossError: the student's attention cannot be rebuilt from its queries and keys (attention sinks, soft-capped
            scores without an eager kernel), naming the way out.
    """
    try:
        with recorder.forward():
            out = run()
    except QKRecorderError as exc:
        raise LossError(f"the student's attention cannot be compared with a q/k cache: {exc}; precompute the cache "
                        f"with --attention-source maps, or train without attention pairs") from None
    out.attention_qkv, recorder.captured = recorder.captured, {}  # the loss holds them, not the recorder
    return out
