"""The loss helpers, under the names the loss modules import (they live in ``stages.common.loss_rows``)."""

from __future__ import annotations

from kdcache.stages.common.loss_rows import (
    LOSS_CHUNK,
    bool_mask,
    count_valid,
    full_precision,
    kl_terms,
    valid_rows,
)

__all__ = ["LOSS_CHUNK", "bool_mask", "count_valid", "full_precision", "kl_terms", "valid_rows"]
