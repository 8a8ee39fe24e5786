"""Logit kinds: one module per ``--logits`` mode, registered by name (see ``base`` and docs/architecture.md,
"Adding a target kind").

Importing this package imports every module beside ``base`` (in name order), and each registers its kind: a new
mode is one new file here (plus its storage layout in ``storage.logit_layouts`` when it stores new arrays).
"""

from __future__ import annotations

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
from kdcache.storage import import_members

import_members(__name__, __path__)

__all__ = ["CaptureSettings", "KlSetup", "LogitKind", "LogitKindError", "from_targets", "get", "names", "parse",
           "register", "usage", "uses_head"]
