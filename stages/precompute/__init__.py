"""Stage one: run the teacher once and write its targets to a cache.

Public API (what ``pipeline`` and the demo call)::

    from kdcache.stages.precompute import PrecomputeOptions, run_precompute, merge_cache, format_summary

    summary = run_precompute(PrecomputeOptions.of(teacher=..., data=..., out=...))
    print(format_summary(summary))

This is stage one's front door: ``pipeline`` imports nothing else of it. Its folders are floors, each importing
only those below it: ``core`` (the options, the plan made of them, the targets, the loaded teacher's record,
progress, errors), ``rows`` (the dataset into the cache's rows), ``parallel`` (a teacher larger than one device)
and ``capture`` (what the forward keeps, and its way to the host), each with a door of its own; on top, this
package's modules run them (``runner``, ``teacher``, ``adapters``, ``stream``, ``cache_spec``, ``commit``). Names
load on first use, so importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.core import (
        PrecomputeError as PrecomputeError,
        PrecomputeOptions as PrecomputeOptions,
        format_summary as format_summary,
        reused_cache as reused_cache,
    )
    from kdcache.stages.precompute.estimate import format_estimate as format_estimate
    from kdcache.stages.precompute.generate import (
        format_generate_estimate as format_generate_estimate,
        run_generate as run_generate,
    )
    from kdcache.stages.precompute.generation import GenerateOptions as GenerateOptions
    from kdcache.stages.precompute.rows import row_problems as row_problems
    from kdcache.stages.precompute.runner import merge_cache as merge_cache, run_precompute as run_precompute
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
