"""``LossError``: what every loss of stage two and every logit kind raises on a misconfiguration or bad input.

Torch-free, so that the logit kinds (``stages.targets.logits``) can be imported by the option classes. It
derives from ``storage.core.errors.KdcacheError``: the CLI turns it into a message and exit status 2.
"""

from __future__ import annotations

from kdcache.storage import KdcacheError


class LossError(KdcacheError, ValueError):
    """A loss was misconfigured or given inputs it cannot use (unknown name, shape or head-count mismatch)."""
