"""The stage-one error type: every bad input becomes a ``PrecomputeError`` (a ``KdcacheError``).

The CLI turns any ``KdcacheError`` into one clean message and exit status 2, so a user who points the
teacher at a missing folder or asks for layer 40 of a 12-layer model sees what to fix, not a traceback.
"""

from __future__ import annotations

from kdcache.storage import KdcacheError


class PrecomputeError(KdcacheError):
    """A teacher, dataset or option that stage one cannot use; the message says which and why."""
