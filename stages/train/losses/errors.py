"""Errors raised by the stage-two loss components.

Both derive from ``storage.errors.KdcacheError``, so the CLI turns them into a one-paragraph message and exit
status 2 instead of a traceback; like storage's own errors they are also ``ValueError`` s.
"""

from __future__ import annotations

from kdcache.storage.errors import KdcacheError


class LossError(KdcacheError, ValueError):
    """A loss was misconfigured or given inputs it cannot use (unknown name, shape or head-count mismatch)."""


class LayerMapError(KdcacheError, ValueError):
    """A layer map is malformed, or needs layers that the student or the cache does not have."""


__all__ = ["KdcacheError", "LossError", "LayerMapError"]
