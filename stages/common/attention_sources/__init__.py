"""Attention sources: one module per ``--attention-source`` value, registered by name (see ``base`` and
docs/architecture.md, "Adding a target kind").

Importing this package imports every module beside ``base`` (in name order), and each registers its source: a new
source is one new file here, plus its storage layout in ``storage.attention_source``.
"""

from __future__ import annotations

import importlib
import pkgutil

from kdcache.stages.common.attention_sources.base import (
    AttentionSource,
    AttentionSourceError,
    choices,
    config_heads,
    get,
    names,
    register,
    usage,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["AttentionSource", "AttentionSourceError", "choices", "config_heads", "get", "names", "register", "usage"]
