"""Stage one: run the teacher once and write its targets to a cache.

Public API (what ``pipeline`` and the demo call)::

    from kdcache.stages.precompute import PrecomputeOptions, run_precompute, merge_cache, format_summary

    summary = run_precompute(PrecomputeOptions.of(teacher=..., data=..., out=...))
    print(format_summary(summary))

This is stage one's front door: ``pipeline`` imports nothing else of it. Its parts are the runner and its
options (``runner``, ``options``, ``targets``, ``teacher``, ``adapters``, ``stream``, ``commit``), and three
sub-packages with doors of their own: ``rows`` (the dataset into the cache's rows), ``parallel`` (a teacher
larger than one device) and ``capture`` (what the forward keeps, and its way to the host). Names load on first
use, so importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.errors import PrecomputeError as PrecomputeError
    from kdcache.stages.precompute.estimate import format_estimate as format_estimate
    from kdcache.stages.precompute.options import PrecomputeOptions as PrecomputeOptions
    from kdcache.stages.precompute.progress import format_summary as format_summary
    from kdcache.stages.precompute.rows import row_problems as row_problems
    from kdcache.stages.precompute.runner import merge_cache as merge_cache, run_precompute as run_precompute

__getattr__, __dir__, __all__ = attach(__name__, __file__)
