"""Stage one's ground floor: what every part of it reads and nothing of it below: the options (``options``) and
the plan the parts take instead (``plan``), the
targets they resolve to against the teacher's config (``targets``), the loaded teacher and its fingerprints
(``teacher_id``), progress and the run's summary (``progress``), ``PrecomputeError`` (``errors``), and one try
at the hub before its local cache only (``hub``).

The floors above import it through this door, each only those below it: ``rows`` (the dataset into rows),
``parallel`` (a teacher larger than one device), ``capture`` (what the forward keeps), and the modules of
``precompute`` itself, which load the teacher and run it shard by shard (``runner``, ``teacher``, ``stream``...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.precompute.core.errors import PrecomputeError as PrecomputeError
    from kdcache.stages.precompute.core.hub import offline_unless_reachable as offline_unless_reachable
    from kdcache.stages.precompute.core.options import (
        DATA_EXTENSIONS as DATA_EXTENSIONS,
        IN_FLIGHT as IN_FLIGHT,
        PACKING as PACKING,
        DatasetOptions as DatasetOptions,
        PrecomputeOptions as PrecomputeOptions,
        StorageOptions as StorageOptions,
        TargetOptions as TargetOptions,
        looks_like_path as looks_like_path,
    )
    from kdcache.stages.precompute.core.plan import (
        BatchSetup as BatchSetup,
        PrecomputePlan as PrecomputePlan,
        RowSetup as RowSetup,
        TeacherSetup as TeacherSetup,
        WriteSetup as WriteSetup,
    )
    from kdcache.stages.precompute.core.progress import (
        Progress as Progress,
        RunStats as RunStats,
        format_summary as format_summary,
        reused_cache as reused_cache,
        summarize as summarize,
        target_of as target_of,
    )
    from kdcache.stages.precompute.core.targets import (
        CAUSAL_SUFFIXES as CAUSAL_SUFFIXES,
        Targets as Targets,
        resolve_targets as resolve_targets,
        settings_fingerprint as settings_fingerprint,
    )
    from kdcache.stages.precompute.core.teacher_id import (
        Teacher as Teacher,
        teacher_files_fingerprint as teacher_files_fingerprint,
        teacher_fingerprint as teacher_fingerprint,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
