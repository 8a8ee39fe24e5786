"""Logit kinds: one module per ``--logits`` mode, registered by name (see ``base`` and docs/architecture.md,
"Adding a target kind").

Importing this package imports every module beside ``base`` (in name order), and each registers its kind: a new
mode is one new file here, whose class holds its storage layout (a ``LogitLayout`` of ``storage.core.logit_layouts``,
an existing one when it stores the same arrays) and registers it with itself.
"""

from __future__ import annotations

from kdcache.stages.common.logit_kinds.base import (
    CaptureSettings,
    KlSetup,
    LogitKind,
    LogitKindError,
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

import_members(__name__, __path__)
# Names the kinds' own modules define, after every kind has registered (registration order is the choices').
from kdcache.stages.common.logit_kinds.base import TeacherHead  # noqa: E402
from kdcache.stages.common.logit_kinds.full import kd_kl  # noqa: E402
from kdcache.stages.common.logit_kinds.head import head_kl  # noqa: E402
from kdcache.stages.common.logit_kinds.sampled import sample_logits, sampled_kl  # noqa: E402
from kdcache.stages.common.logit_kinds.topk import (  # noqa: E402
    TOPK_VARIANTS,
    as_logprobs,
    cached_topk,
    topk_kl,
    topk_kl_other,
    topk_kl_renorm,
)

__all__ = ["CaptureSettings", "KlSetup", "LogitKind", "LogitKindError", "TOPK_VARIANTS", "TeacherHead", "as_logprobs",
           "cached_topk", "from_targets", "get", "head_kl", "kd_kl", "kinds", "names", "of", "parse", "register",
           "sample_logits", "sampled_kl", "topk_kl", "topk_kl_other", "topk_kl_renorm", "usage", "uses_head"]
