"""Logit kinds: one module per ``--logits`` mode, registered by name (see ``base`` and docs/architecture.md,
"Adding a target kind"). Importing this package registers the modes below, in this order."""

from __future__ import annotations

from kdcache.stages.common.logit_kinds import full, head, sampled, topk  # noqa: F401 (each registers its kind)
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
)

__all__ = ["CaptureSettings", "KlSetup", "LogitKind", "LogitKindError", "from_targets", "get", "names", "parse",
           "register", "usage"]
