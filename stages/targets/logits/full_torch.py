"""The torch half of ``--logits full`` (``full``): the capture keeps the logits whole, the term is the KD KL."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.base import KlSetup, LogitSettings
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.vocab import kernel_feeds, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm


def capture(logits: torch.Tensor, settings: LogitSettings,
            generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """``logits/full [..., V]`` as computed (the caller checks the range and converts to the float dtype)."""
    return {"logits/full": logits}


def chunk_term(logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
               setup: KlSetup) -> ChunkTerm:
    """The KD KL against ``logits/full`` at ``setup.temperature``."""
    return kd_kl_term(logits, targets["logits/full"], mask, setup.temperature)


def teacher_top1(targets: Mapping[str, torch.Tensor], valid: torch.Tensor, head: TeacherHead | None) -> torch.Tensor:
    """``[N_v]`` the argmax of the cached logits at the ``valid [B, L]`` positions."""
    return targets["logits/full"][valid].argmax(-1)


def kd_kl_term(student_logits: torch.Tensor | HeadLogits, teacher_logits: torch.Tensor, mask: torch.Tensor,
               temperature: float = 1.0) -> ChunkTerm:
    """T² · mean over valid tokens of KL(softmax(z_t/T) ‖ softmax(z_s/T)): ``batchmean`` over ``[N_v, V]``, as a
    term of a vocabulary pass (``vocab_pass``; ``kd_kl`` is its scalar value).

    Args:
        student_logits: ``[B, L, V]``, or the ``HeadLogits`` behind them (built chunk by chunk).
        teacher_logits: ``[B, L, V]`` (the cache's ``logits/full``), any float dtype: the cache's fp16 / bf16 as
            stored (``to_device`` keeps it), each chunk of the pass widening its own rows to float32.
        mask: ``[B, L]``.
        temperature: T > 0.
    """
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


kd_kl = vocab_pass.as_loss(kd_kl_term, "kd_kl")
