"""Attention sources: one module per ``--attention-source`` value, registered by name (see ``base`` and
docs/architecture.md, "Adding a target kind").

Importing this package imports every module beside ``base``, ``flags`` and the torch modules (in name order), and
each registers its source: a new source is one new file here, whose class holds its storage layout (an
``AttentionLayout`` of ``storage.core.attention_source``) and registers it with itself.

The family's torch side lives here too, loaded only by who computes: ``qk_attention`` (the queries and keys
recorded on a forward and the scores rebuilt from them, both stages), ``attention_maps`` (the student's eager
maps), and the student's loss terms, ``maps_loss`` (KL against cached maps) and ``qk_loss`` (against cached
queries and keys).
"""

from __future__ import annotations

from kdcache.stages.targets.attention.base import (
    AttentionSettings,
    AttentionSource,
    get,
    names,
    of,
    register,
)
from kdcache.storage import import_members

# The torch modules register nothing, and the registry must load without torch.
TORCH_MODULES = ("attention_maps", "maps_loss", "qk_attention", "qk_loss")
# flags too: its help lists the sources, so it loads after them (its importers load this package first).
import_members(__name__, __path__, but=("base", "flags", *TORCH_MODULES))

__all__ = ["AttentionSettings", "AttentionSource", "get", "names", "of", "register"]
