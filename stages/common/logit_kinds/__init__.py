"""Logit kinds: one module per ``--logits`` mode, registered by name (see ``base`` and docs/architecture.md,
"Adding a target kind").

Importing this package imports every module beside ``base`` (in name order), and each registers its kind: a new
mode is one new file here (plus its storage layout in ``storage.logit_layouts`` when it stores new arrays).
"""

from __future__ import annotations

import importlib
import pkgutil

from kdcache.stages.common.logit_kinds.base import (
    CaptureSettings,
    KlSetup,
    LogitKind,
    LogitKindError,
    from_targets,
    get,
    names,
    parse,
    register,
    usage,
    uses_head,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CaptureSettings", "KlSetup", "LogitKind", "LogitKindError", "from_targets", "get", "names", "parse",
           "register", "usage", "uses_head"]
