"""Errors raised by the stage-two loss components.

``LayerMapError`` lives in ``layer_maps`` (the options check map syntax without importing torch). Both derive
from ``storage.core.errors.KdcacheError``, so the CLI turns them into a one-paragraph message and exit status 2
instead of a traceback; like storage's own errors they are also ``ValueError`` s.
"""

from __future__ import annotations

from kdcache.stages.common.loss_errors import LossError  # shared with the logit kinds (stages.common)
from kdcache.stages.train.core import LayerMapError  # defined with the maps, torch-free for the config
from kdcache.storage import KdcacheError

__all__ = ["KdcacheError", "LossError", "LayerMapError"]
