"""``--logits head``: nothing per token; the cache keeps the teacher's last hidden layer (after its final norm)
and a copy of its LM head (``teacher_head/``), from which stage two computes exact logits chunk by chunk.

Stage one runs the head in chunks of valid tokens only to check, on the first batch, that the model's logits are
its head applied to its last layer (``precompute.logit_head.ChunkedHead``). Only decoder-only causal LMs qualify.
Stage two's term is ``kl`` (``head_kl``, exact at any T); the student's head must have exactly V outputs.
Torch-free: the term and the decode are its torch half, ``head_torch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kdcache.stages.targets.logits.base import LogitKind, register
from kdcache.storage import HEAD_LAYOUT

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

    def describe(self, info: Mapping[str, Any]) -> str:
        return f"the teacher's LM head on its last layer (teacher_head/), V={info['vocab_size']}"
