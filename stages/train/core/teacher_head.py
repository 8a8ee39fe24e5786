"""Exact teacher logits for caches written with ``--logits head``: the teacher's LM head on its cached last layer.

Nothing per token is stored for logits; the cache holds the teacher's last hidden layer N (after its final norm,
as HF numbers it) and a copy of its LM head. ``TeacherHead`` applies that head to the cached states of the valid
tokens only, in the head's own dtype like the teacher did, giving ``[N_v, V]`` logits at any temperature. The
head's weights are buffers, not parameters: nothing trains them and checkpoints leave them out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from kdcache.stages.common.teacher_head import finish_logits, read_head
from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    from kdcache.storage import Store


class TeacherHead(nn.Module):
    """``forward(hidden [N, d]) -> logits [N, V]`` float32.

    Args:
        tensors: ``weight [V, d]`` and optionally ``bias [V]``.
        info: ``head.json`` (``layer``, ``logit_scale``, ``softcap``...).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, tensors: dict[str, torch.Tensor], info: dict[str, Any]):
        super().__init__()
        self.register_buffer("weight", tensors["weight"], persistent=False)
        self.register_buffer("bias", tensors.get("bias"), persistent=False)
        self.layer = int(info["layer"])
        self.scale, self.softcap = info.get("logit_scale"), info.get("softcap")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        return finish_logits(logits, self.scale, self.softcap)

    def describe(self) -> str:
        """Its size, for the start of a training log."""
        kept = [t for t in (self.weight, self.bias) if t is not None]
        count = sum(int(t.numel()) for t in kept)
        mib = sum(int(t.numel()) * t.element_size() for t in kept) / 2**20
        return (f"teacher head from the cache: {count / 1e6:.1f}M parameters, {mib:,.1f} MiB "
                f"({str(self.weight.dtype).replace('torch.', '')}), applied to cached layer {self.layer}")


def load_teacher_head(store: Store,
 hidden_layers: tuple[int, ...] | None = None) -> TeacherHead:
    """The head of a ``--logits head`` cache (its hash checked; ``head.json`` is not hashed, so the layer it
    names is checked against the cache's deepest ``hidden_layers``, the one stage two streams for it).

    Raises:
        KdcacheError: the head cannot be read, is damaged, or reads another layer.
    """
    tensors, info = read_head(store)
    head = TeacherHead(tensors, info)
    if hidden_layers is not None and head.layer != max(hidden_layers, default=-1):
        raise KdcacheError(f"the cache's teacher_head/ reads layer {head.layer}, but its last cached hidden layer is "
                           f"{max(hidden_layers, default=None)}; rerun stage one")
    return head
