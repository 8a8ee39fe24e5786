"""``--logits full``: every token's ``[V]`` teacher logits, stored whole in the cache's float dtype.

Its stage-two term is the KD KL ``kl`` (``kd_kl``: T² · KL at temperature T over the full vocabulary); eval
reports the same KL at T=1. The student's head must have exactly V outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kdcache.lazy_exports import deferred
from kdcache.stages.common.logit_kinds.base import CaptureSettings, KlSetup, LogitKind, TeacherHead, register
from kdcache.stages.common.loss_errors import LossError
from kdcache.storage import FULL_LAYOUT

if TYPE_CHECKING:
    import torch

    from kdcache.stages.common import kernel_feeds, loss_rows, vocab_pass
    from kdcache.stages.common.head_logits import HeadLogits
    from kdcache.stages.common.vocab_pass import ChunkTerm
else:  # torch's side loads on first use, so that the registry and the option checks import without it
    kernel_feeds, loss_rows, vocab_pass = deferred(
        "kdcache.stages.common.kernel_feeds", "kdcache.stages.common.loss_rows", "kdcache.stages.common.vocab_pass")


@register
class Full(LogitKind):
    """The full logits (see the module docstring)."""

    layout = FULL_LAYOUT
    kl_form = "full"
    exact_vocab = True
    key_array = "logits/full"

    def capture(self, logits: torch.Tensor, settings: CaptureSettings,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``logits/full [..., V]`` as computed (the caller checks the range and converts to the float dtype)."""
        return {"logits/full": logits}

    def chunk_term(self, logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                   setup: KlSetup) -> ChunkTerm:
        return kd_kl_term(logits, targets["logits/full"], mask, setup.temperature)

    def teacher_top1(self, targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                     head: TeacherHead | None) -> torch.Tensor:
        return targets["logits/full"][valid].argmax(-1)

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"full, V={info['vocab_size']}"


def kd_kl(student_logits: torch.Tensor | HeadLogits, teacher_logits: torch.Tensor, mask: torch.Tensor,
          temperature: float = 1.0) -> torch.Tensor:
    """T² · mean over valid tokens of KL(softmax(z_t/T) ‖ softmax(z_s/T)): ``batchmean`` over ``[N_v, V]``.

    Args:
        student_logits: ``[B, L, V]``, or the ``HeadLogits`` behind them (built chunk by chunk).
        teacher_logits: ``[B, L, V]`` (the cache's ``logits/full``), any float dtype: the cache's fp16 / bf16 as
            stored (``to_device`` keeps it), each chunk of the pass widening its own rows to float32.
        mask: ``[B, L]``.
        temperature: T > 0.

    Returns:
        Scalar.
    """
    return vocab_pass.term_value(student_logits, kd_kl_term(student_logits, teacher_logits, mask, temperature))


def kd_kl_term(student_logits: torch.Tensor | HeadLogits, teacher_logits: torch.Tensor, mask: torch.Tensor,
               temperature: float = 1.0) -> ChunkTerm:
    """``kd_kl`` as a term of a vocabulary pass (``vocab_pass``)."""
    loss_rows.check_temperature(temperature)
    if student_logits.shape != teacher_logits.shape:
        raise LossError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "differ; the student and the cache must share one vocabulary"
        )
    m = loss_rows.bool_mask(mask, student_logits)
    feed = kernel_feeds.dense_kl_feed(temperature, lambda z_t: z_t)
    return vocab_pass.ChunkTerm(lambda z, z_t: loss_rows.kl_row_values(z, z_t, temperature), m, (teacher_logits,),
                                temperature**2 / loss_rows.valid_count(m), feed=feed)
