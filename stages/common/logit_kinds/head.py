"""``--logits head``: nothing per token; the cache keeps the teacher's last hidden layer (after its final norm)
and a copy of its LM head (``teacher_head/``), from which stage two computes exact logits chunk by chunk.

Stage one runs the head in chunks of valid tokens only to check, on the first batch, that the model's logits are
its head applied to its last layer (``precompute.logit_head.ChunkedHead``). Only decoder-only causal LMs qualify.
Stage two's term is ``kl`` (``head_kl``, exact at any T); the student's head must have exactly V outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kdcache.lazy_exports import deferred
from kdcache.stages.common.logit_kinds.base import KlSetup, LogitKind, TeacherHead, register
from kdcache.stages.common.loss_errors import LossError
from kdcache.storage import HEAD_LAYOUT

if TYPE_CHECKING:
    import torch

    from kdcache.stages.train.vocab import ChunkTerm, HeadLogits, kernel_feeds, loss_rows, vocab_pass
else:  # torch's side loads on first use, so that the registry and the option checks import without it
    torch, kernel_feeds, loss_rows, vocab_pass = deferred(
        "torch", "kdcache.stages.train.vocab.kernel_feeds", "kdcache.stages.train.vocab.loss_rows",
        "kdcache.stages.train.vocab.vocab_pass")

HEAD_CHUNK = 512  # valid tokens per chunk of the check when --logits-chunk leaves chunking off


@register
class Head(LogitKind):
    """The teacher's LM head on its cached last layer (see the module docstring)."""

    layout = HEAD_LAYOUT
    kl_form = "full"  # the full distribution, rebuilt
    exact_vocab = True
    teacher_head = True

    def teacher_problems(self, teacher: str, one_stream: bool, causal: bool, vocab: int, top_k: int) -> list[str]:
        if not (one_stream and causal):
            return [f"logits head: only for decoder-only causal LMs, and {teacher!r} is not one; use --logits topk "
                    f"or full"]
        return []

    def capture_chunk(self, chunk_tokens: int) -> int:
        return chunk_tokens or HEAD_CHUNK

    def chunk_term(self, logits: torch.Tensor | HeadLogits, targets: Mapping[str, torch.Tensor], mask: torch.Tensor,
                   setup: KlSetup) -> ChunkTerm:
        head = _head(setup.head)
        return head_kl_term(logits, _last_layer(targets, head), head, mask, setup.temperature)

    def teacher_top1(self, targets: Mapping[str, torch.Tensor], valid: torch.Tensor,
                     head: TeacherHead | None) -> torch.Tensor:
        """Chunk by chunk: ``[N_v, V]`` teacher logits never exist at once."""
        rows = _last_layer(targets, _head(head))[valid]
        return torch.cat([_head(head)(part).argmax(-1) for part in rows.split(loss_rows.LOSS_CHUNK)])

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"the teacher's LM head on its last layer (teacher_head/), V={info['vocab_size']}"


def _head(head: TeacherHead | None) -> TeacherHead:
    if head is None:
        raise LossError("a --logits head cache needs the teacher's LM head (its teacher_head/), and none was loaded")
    return head


def _last_layer(targets: Mapping[str, torch.Tensor], head: TeacherHead) -> torch.Tensor:
    name = f"hidden/{head.layer}"
    if name not in targets:
        raise LossError(f"the loss needs the cached target {name!r}, but the batch holds {', '.join(sorted(targets))}")
    return targets[name]


def head_kl(student_logits: torch.Tensor | HeadLogits, hidden_t: torch.Tensor,
            head: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``kd_kl`` with the teacher's logits rebuilt from its cached last hidden layer through its LM head (caches
    written with ``--logits head``), for the valid tokens only: no ``[B, L, V]`` teacher tensor exists.

    Args:
        student_logits: ``[B, L, V]``, or the ``HeadLogits`` behind them.
        hidden_t: ``[B, L, d]`` the teacher's last hidden layer (after its final norm).
        head: maps ``[N_v, d]`` to ``[N_v, V]`` float32 logits (``stages.common.teacher_head.TeacherHead``).
        mask: ``[B, L]``.
        temperature: T > 0; exact at any T, since the full distribution is rebuilt.
    """
    return vocab_pass.term_value(student_logits, head_kl_term(student_logits, hidden_t, head, mask, temperature))


def head_kl_term(student_logits: torch.Tensor | HeadLogits, hidden_t: torch.Tensor,
                 head: Callable[[torch.Tensor], torch.Tensor], mask: torch.Tensor,
                 temperature: float = 1.0) -> ChunkTerm:
    """``head_kl`` as a term of a vocabulary pass (``vocab_pass``): the teacher's ``[C, V]`` logits are rebuilt
    chunk by chunk beside the student's."""
    loss_rows.check_temperature(temperature)
    m = loss_rows.bool_mask(mask, student_logits)
    # Fused: the teacher's [C, V] logits from a second matmul per chunk, read by the kernel beside the student's.
    feed = kernel_feeds.dense_kl_feed(temperature, head)
    return vocab_pass.ChunkTerm(lambda z, rows: loss_rows.kl_row_values(z, head(rows), temperature), m, (hidden_t,),
                                temperature**2 / loss_rows.valid_count(m), feed=feed)
