"""Attention sources: one module per ``--attention-source`` value, registered by name (see ``base`` and
docs/architecture.md, "Adding a target kind").

Importing this package imports every module beside ``base`` (in name order), and each registers its source: a new
source is one new file here, whose class holds its storage layout (an ``AttentionLayout`` of
``storage.core.attention_source``) and registers it with itself.
"""

from __future__ import annotations

from kdcache.stages.common.attention_sources.base import (
    AttentionSource,
    AttentionSourceError,
    choices,
    config_heads,
    get,
    names,
    of,
    register,
    usage,
)
from kdcache.storage import import_members

import_members(__name__, __path__)

__all__ = ["AttentionSource", "AttentionSourceError", "choices", "config_heads", "get", "names", "of", "register",
           "usage"]
