"""Learnable projectors from the student's hidden size to the teacher's, one ``nn.Linear`` per mapped pair.

They live inside ``CompoundLoss``, itself inside the module handed to DeepSpeed, so the engine optimizes (and
under ZeRO-3 partitions) them with the student. Call them through ``Projectors.project`` (module calls, never
``F.linear`` on their weights) so ZeRO-3's hooks gather their parameters first. They are saved apart from
the student, whose export stays a plain HF model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from kdcache.stages.train.core.layer_maps import Pair, pair_key


class Projectors(nn.Module):
    """One ``nn.Linear(d_s, d_t)`` per (student, teacher) pair, keyed ``"s{j}_t{i}"``.

    None are created for an empty map (``CompoundLoss`` gives one to a loss without a projector, CKA);
    ``project`` is then the identity.

    Init (bias zero):
      * d_s == d_t: the exact identity. A student initialised from teacher layers (``init-student``) already
        lives in the teacher's space, and for any other student it is the neutral starting point.
      * d_s != d_t: a random semi-orthogonal matrix. When d_t >= d_s its columns are orthonormal, an exact
        isometry (‖Wx‖ = ‖x‖); when d_t < d_s its rows are, scaled by sqrt(d_s/d_t) so ‖Wx‖ ≈ ‖x‖ on average.
        Either way the projected states start at the student's own scale, not near zero, and no direction is
        favoured — unlike ``eye(d_t, d_s) + 1e-6``, which copies an arbitrary slice of coordinates.

    Args:
        pairs: the layer map.
        student_dim: d_s.
        teacher_dim: d_t.
        seed: seeds the semi-orthogonal inits (the same on every rank).
    """

    def __init__(self, pairs: Sequence[Pair], student_dim: int, teacher_dim: int, *, seed: int = 0):
        super().__init__()
        self.student_dim = student_dim
        self.teacher_dim = teacher_dim
        keys = [pair_key(p) for p in pairs]
        generator = torch.Generator().manual_seed(seed)
        # dict.fromkeys: a pair listed twice shares one projector.
        self.layers = nn.ModuleDict({k: self._make(generator) for k in dict.fromkeys(keys)})

    def project(self, pair: Pair, h_s: torch.Tensor) -> torch.Tensor:
        """Map ``[..., d_s]`` student states of ``pair`` to ``[..., d_t]`` (identity when there is no projector)."""
        key = pair_key(pair)
        if key not in self.layers:
            return h_s
        return self.layers[key](h_s)

    def _make(self, generator: torch.Generator) -> nn.Linear:
        layer = nn.Linear(self.student_dim, self.teacher_dim)
        with torch.no_grad():
            if self.student_dim == self.teacher_dim:
                layer.weight.copy_(torch.eye(self.teacher_dim))
            else:
                gain = math.sqrt(max(1.0, self.student_dim / self.teacher_dim))
                nn.init.orthogonal_(layer.weight, gain=gain, generator=generator)
            layer.bias.zero_()
        return layer
