"""The student's forward without its LM head: when the vocabulary losses take ``HeadLogits`` (the last hidden state
and the head, applied chunk by chunk inside the losses), the student runs its base model only, and its
``[B, L, V]`` logits are never built.

That is exact only when the model's logits *are* its head on its base model's last hidden state: a plain
``nn.Linear`` head, no logit scaling or soft-capping after it (Gemma 2, Cohere, Granite scale or cap), whole on this
rank (ZeRO-3 partitions it). ``head_problem`` checks the first batch, as ``documents_apart_problem`` does; a student
that fails keeps the model's own forward and materialised logits, and train says which path it took.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kdcache.stages.targets.logits.vocab.fused_vocab import vocab_path
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_TOLERANCE = 1e-3  # relative to the largest logit: the same kernels on the same inputs agree to rounding


def plain_head(student: PreTrainedModel) -> nn.Linear | None:
    """The student's LM head when it is a whole ``nn.Linear`` beside a distinct base model, else None."""
    head = student.get_output_embeddings()
    base = getattr(student, "base_model", None)
    if not isinstance(head, nn.Linear) or base is None or base is student:
        return None
    if hasattr(head.weight, "ds_id"):  # a ZeRO-3 partition: the weight is gathered only inside the head's forward
        return None
    return head


def head_problem(student: PreTrainedModel, head: nn.Linear, inputs: Mapping[str, Any]) -> str | None:
    """None when, on the first row of ``inputs``, the student's logits are ``head(base(x).last_hidden_state)``; else
    the difference found. Runs in eval mode without gradients, so dropout does not count."""
    first = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    training = student.training
    student.eval()
    try:
        with torch.no_grad():
            full = student(**first).logits.float()
            rebuilt = head(student.base_model(**first).last_hidden_state).float()
    finally:
        student.train(training)
    if full.shape != rebuilt.shape:
        return f"its logits {tuple(full.shape)} are not its head's {tuple(rebuilt.shape)}"
    gap = float((full - rebuilt).abs().max())
    if gap > HEAD_TOLERANCE * max(1.0, float(full.abs().max())):
        return f"its logits differ from its LM head on its last hidden state by up to {gap:.3g}"
    return None


def choose_head(student: PreTrainedModel, inputs: Mapping[str, Any], one_stream: bool,
                announce: bool = True) -> nn.Linear | None:
    """The head the losses apply themselves (None: the model's own forward), said once when ``announce`` (rank 0,
    without --quiet)."""
    head = plain_head(student) if one_stream else None
    problem = None if head is None else head_problem(student, head, inputs)
    device = next(student.parameters()).device
    if head is not None and problem is None:
        words = vocab_path(device)
    else:
        why = problem or "its LM head is not a plain linear layer beside a base model (or is split by ZeRO-3)"
        words = f"materialised logits from {type(student).__name__}'s own forward ({why})"
        head = None
    if announce and int(os.environ.get("RANK", "0")) == 0:
        print(f"kdcache train: vocabulary losses: {words}", file=sys.stderr)
    return head


def base_forward(student: PreTrainedModel, head: nn.Linear, inputs: Mapping[str, Any], *, hidden: bool,
                 attentions: bool) -> SimpleNamespace:
    """The student's outputs with ``logits`` as ``HeadLogits`` (``[B, L, V]`` never built) from its base model."""
    out = student.base_model(**inputs, output_hidden_states=hidden, output_attentions=attentions)
    return SimpleNamespace(logits=HeadLogits(out.last_hidden_state, head.weight, head.bias),
                           hidden_states=out.hidden_states, attentions=getattr(out, "attentions", None))
