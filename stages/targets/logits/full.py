"""``--logits full``: every token's ``[V]`` teacher logits, stored whole in the cache's float dtype.

Its stage-two term is the KD KL ``kl`` (``full_torch.kd_kl``: T² · KL at temperature T over the full vocabulary);
eval reports the same KL at T=1. The student's head must have exactly V outputs. Torch-free: the capture and the
term are its torch half, ``full_torch``.
"""

from __future__ import annotations

from kdcache.stages.targets.logits.base import LogitKind, register
from kdcache.storage import FULL_LAYOUT


@register
class Full(LogitKind):
    """The full logits (see the module docstring)."""

    layout = FULL_LAYOUT
    kl_form = "full"
    exact_vocab = True
    key_array = "logits/full"
