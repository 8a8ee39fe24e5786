"""Logit kinds: one mode per ``--logits`` value, registered by name; a mode is two modules here (see ``base`` and
docs/architecture.md, "Adding a target kind"). Importing this package imports every torch-free module beside
``base`` (in name order) and no torch half, so the registry, the option classes and ``kdcache inspect`` load
without torch. Stage two reaches a torch half's functions as a module of this package (``from
kdcache.stages.targets.logits import topk_torch``).

``teacher_head`` is the ``head`` mode's copy of the teacher's LM head (stage one exports it, stage two and the
draft load it). ``vocab/`` is the vocabulary pass the torch halves' loss terms run in (stage two's one pass over
the LM head); it lives in the family because the kinds need it and it needs nothing of stage two.
"""

from __future__ import annotations

import pkgutil

from kdcache.stages.targets.logits.base import (
    TORCH_HALF,
    KlSetup,
    LogitFlags,
    LogitKind,
    LogitKindError,
    LogitSettings,
    from_targets,
    get,
    kinds,
    names,
    of,
    parse,
    register,
    usage,
    uses_head,
)
from kdcache.storage import import_members

# Neither the torch halves, ``teacher_head`` nor ``vocab/`` register anything, and all import torch.
import_members(__name__, __path__, but=["base", "teacher_head",
                                       *(m.name for m in pkgutil.iter_modules(__path__)
                                         if m.name.endswith(TORCH_HALF) or m.ispkg)])

__all__ = ["KlSetup", "LogitFlags", "LogitKind", "LogitKindError", "LogitSettings", "from_targets", "get", "kinds",
           "names", "of", "parse", "register", "usage", "uses_head"]
