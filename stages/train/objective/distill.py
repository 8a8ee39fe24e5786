"""The student's side of the run's loss (``train.loss.DistillationLoss``), below ``cross`` and ``evaluation``, which
use it too: its forward arguments from a collated batch, one token stream's view of its outputs, the check that
packed documents stay apart, the transformers model inside a PEFT one, and its forward with its queries and keys
recorded for a q/k cache (``recorded``: training and evaluation compare the same rebuilt attention with the cache).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from kdcache.stages.common.architectures import is_causal_config
from kdcache.stages.common.documents import document_attention_mask, documents_apart_problem
from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.attention.qk_attention import QKRecorder, QKRecorderError
from kdcache.stages.train.objective.compound import StudentOutput
from kdcache.storage import ArrayKind

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def student_view(out: StudentOutput, stream: str, main: bool) -> StudentOutput:
    """The student's outputs for one stream: HF names them ``hidden_states`` for one stack and
    ``encoder_hidden_states`` / ``decoder_hidden_states`` (same for attentions) for two."""
    if not stream:
        return out
    return SimpleNamespace(logits=out.logits if main else None,
                           hidden_states=getattr(out, f"{stream}_hidden_states"),
                           attentions=getattr(out, f"{stream}_attentions"))


def student_inputs(student: PreTrainedModel, batch: Mapping[str, torch.Tensor],
                   causal: bool | None = None) -> dict[str, Any]:
    """The student's forward arguments from a collated batch (see ``streaming.collate``).

    One stream: ``input_ids`` and ``mask``; rows packed with documents kept apart also give ``position_ids`` and
    the 4-D mask that keeps attention inside each document, as the teacher had. Two streams: the encoder's ids
    and mask, and the decoder teacher-forced on the cached decoder ids (the labels), shifted by the student's
    own rule. ``causal``: whether the student attends causally (worked out from its config when None).
    """
    if ArrayKind.INPUT_IDS in batch and ArrayKind.POSITION_IDS in batch:
        causal = is_causal_config(student.config) if causal is None else causal
        mask = document_attention_mask(batch["position_ids"], batch["mask"], causal=causal, dtype=student.dtype)
        return {"input_ids": batch["input_ids"], "attention_mask": mask, "position_ids": batch["position_ids"]}
    if ArrayKind.INPUT_IDS in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["mask"]}
    labels = batch["decoder/input_ids"]
    return {"input_ids": batch["encoder/input_ids"], "attention_mask": batch["encoder/mask"],
            "decoder_input_ids": student.prepare_decoder_input_ids_from_labels(labels=labels),  # type: ignore[operator]
            "decoder_attention_mask": batch["decoder/mask"], "use_cache": False}


def check_documents_apart(student: PreTrainedModel, batch: Mapping[str, torch.Tensor]) -> None:
    """On a batch of rows packed with documents kept apart, refuse a student that does not keep them apart the way
    the teacher did (``stages.common.documents.documents_apart_problem``), in eval mode so dropout does not count.

    Raises:
        LossError: naming the student class and the difference.
    """
    if ArrayKind.POSITION_IDS not in batch:
        return
    training = student.training
    student.eval()
    try:
        with torch.no_grad():
            problem = documents_apart_problem(student, batch["input_ids"], batch["mask"], batch["position_ids"],
                                              causal=is_causal_config(student.config))
    finally:
        student.train(training)
    if problem is not None:
        raise LossError(f"packed documents: the student {type(student).__name__} does not keep them apart with "
                        f"restarting positions and a 4-D mask ({problem}); use a cache written with --packing "
                        f"concat or none for this student")


def unwrapped_student(student: object) -> PreTrainedModel:
    """The transformers model that runs: a PEFT model's own (its adapters are injected into that model's layers, so
    they run with it and its hidden states are the adapted ones), else ``student`` itself."""
    get_base = getattr(student, "get_base_model", None)
    return cast("PreTrainedModel", get_base() if callable(get_base) else student)


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
