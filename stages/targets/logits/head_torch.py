"""The torch half of ``--logits head`` (``head``): the teacher's logits rebuilt from its cached last layer through
its LM head, chunk by chunk beside the student's, as a term of the vocabulary pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from kdcache.stages.common.loss_errors import LossError
from kdcache.stages.targets.logits.base import KlSetup, LogitSettings
from kdcache.stages.targets.logits.teacher_head import TeacherHead
from kdcache.stages.targets.logits.vocab import kernel_feeds, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm


def capture(logits: torch.Tensor, settings: LogitSettings,
            generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Nothing per token: the cache keeps the teacher's last layer and its head instead."""
    return {}


def chunk_term(logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
               setup: KlSetup) -> ChunkTerm:
    """The exact KD KL against the logits ``setup.head`` rebuilds from the cached last layer."""
    head = _head(setup.head)
    return head_kl_term(logits, _last_layer(targets, head), head, mask, setup.temperature)


def teacher_top1(targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                 head: TeacherHead | None) -> torch.Tensor:
    """Chunk by chunk: ``[N_v, V]`` teacher logits never exist at once."""
    rows = _last_layer(targets, _head(head))[valid]
    return torch.cat([_head(head)(part).argmax(-1) for part in rows.split(loss_rows.LOSS_CHUNK)])


def _head(head: TeacherHead | None) -> TeacherHead:
    if head is None:
        raise LossError("a --logits head cache needs the teacher's LM head (its teacher_head/), and none was loaded")
    return head


def _last_layer(targets: Mapping[str, torch.Tensor], head: TeacherHead) -> torch.Tensor:
    name = f"hidden/{head.layer}"
    if name not in targets:
        raise LossError(f"the loss needs the cached target {name!r}, but the batch holds {', '.join(sorted(targets))}")
    return targets[name]


def head_kl_term(student_logits: torch.Tensor | HeadLogits, hidden_t: torch.Tensor,
                 head: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor,
                 temperature: float = 1.0) -> ChunkTerm:
    """``kd_kl`` with the teacher's logits rebuilt from its cached last hidden layer through its LM head (caches
    written with ``--logits head``), for the valid tokens only: no ``[B, L, V]`` teacher tensor exists. A term of a
    vocabulary pass (``vocab_pass``; ``head_kl`` is its scalar value): the teacher's ``[C, V]`` logits are rebuilt
    chunk by chunk beside the student's.

    Args:
        student_logits: ``[B, L, V]``, or the ``HeadLogits`` behind them.
        hidden_t: ``[B, L, d]`` the teacher's last hidden layer (after its final norm).
        head: maps ``[N_v, d]`` to ``[N_v, V]`` float32 logits (``stages.targets.logits.teacher_head.TeacherHead``).
        mask: ``[B, L]``.
        temperature: T > 0; exact at any T, since the full distribution is rebuilt.
    """
    loss_rows.check_temperature(temperature)
    m = loss_rows.bool_mask(mask, student_logits)
    # Fused: the teacher's [C, V] logits from a second matmul per chunk, read by the kernel beside the student's.
    feed = kernel_feeds.dense_kl_feed(temperature, head)
    return vocab_pass.ChunkTerm(lambda z, rows: loss_rows.kl_row_values(z, head(rows), temperature), m, (hidden_t,),
                                temperature**2 / loss_rows.valid_count(m), feed=feed)


head_kl = vocab_pass.as_loss(head_kl_term, "head_kl")
