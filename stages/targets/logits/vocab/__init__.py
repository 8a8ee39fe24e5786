"""Stage two's one pass over the LM head: the student's ``[B, L, V]`` logits chunk by chunk (``head_logits``), the
rows a term counts (``loss_rows``), the pass over every vocabulary term of a step (``vocab_pass``) and, on CUDA
with triton, its fused kernel (``fused_vocab``, ``kernel_feeds``, ``kernel_guard``; ``vocab_kernels`` imports
triton and loads only when the kernel runs).

Part of the logit family: it imports nothing of either stage, and stage one loads it only with a logit kind's torch
half, at capture. Its users are those torch halves, whose loss terms are terms of this pass, and stage two's
losses and objective. Every module here imports torch, so this package loads them at once (an eager package, not a
lazy door). ``vocab_pass`` here is the module: its function is ``vocab_pass.vocab_pass``.
"""

from __future__ import annotations

from kdcache.stages.targets.logits.vocab import fused_vocab, kernel_feeds, kernel_guard, loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.fused_vocab import vocab_path
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits, fused_ce_available, fused_ce_sum
from kdcache.stages.targets.logits.vocab.kernel_feeds import ce_feed
from kdcache.stages.targets.logits.vocab.loss_rows import (
    bool_mask,
    count_valid,
    full_precision,
    kl_terms,
    tied_zero,
    valid_count,
    valid_rows,
)
from kdcache.stages.targets.logits.vocab.vocab_pass import ChunkTerm, term_value

__all__ = ["ChunkTerm", "HeadLogits", "bool_mask", "ce_feed", "count_valid", "full_precision", "fused_ce_available",
           "fused_ce_sum", "fused_vocab", "kernel_feeds", "kernel_guard", "kl_terms", "loss_rows", "term_value",
           "tied_zero", "valid_count", "valid_rows", "vocab_pass", "vocab_path"]
