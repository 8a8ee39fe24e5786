"""Stage one: run the teacher once and write its targets to a cache.

Public API (what ``pipeline`` and the demo call)::

    from kdcache.stages.precompute import PrecomputeOptions, run_precompute, merge_cache, format_summary

    summary = run_precompute(PrecomputeOptions.of(teacher=..., data=..., out=...))
    print(format_summary(summary))

Heavy imports (torch, transformers, datasets) happen inside the functions, so importing this package is cheap.
"""

from __future__ import annotations

from typing import Any

from kdcache.stages.precompute.errors import PrecomputeError
from kdcache.stages.precompute.options import PrecomputeOptions


def run_precompute(options: PrecomputeOptions) -> dict[str, Any]:
    """See ``stages.precompute.runner.run_precompute``."""
    from kdcache.stages.precompute.runner import run_precompute as run

    return run(options)


def merge_cache(path: str) -> dict[str, Any]:
    """See ``stages.precompute.runner.merge_cache``."""
    from kdcache.stages.precompute.runner import merge_cache as merge

    return merge(path)


def format_summary(summary: dict[str, Any]) -> str:
    """See ``stages.precompute.progress.format_summary``."""
    from kdcache.stages.precompute.progress import format_summary as fmt

    return fmt(summary)


__all__ = ["PrecomputeError", "PrecomputeOptions", "run_precompute", "merge_cache", "format_summary"]
