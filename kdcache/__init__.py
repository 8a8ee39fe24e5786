"""kdcache: cache a Hugging Face teacher's hidden states, attention maps and logits once, then distil students
from the cache under DeepSpeed ZeRO.

The three packages live at the top of the source tree and install under this one name, so that a user's own
``pipeline.py``, ``stages.py`` or ``storage/`` in the working directory never shadows them:

- ``kdcache.pipeline``: the face (the ``kdcache`` CLI, config, demo, reports, sweeps);
- ``kdcache.stages``: stage one (teacher precompute) and stage two (student training);
- ``kdcache.storage``: the cache format, its backends and stores.

Data flows one way: pipeline -> stages -> storage.

The names below are the Python API for training from a cache in your own code (README, "From your own training
code"): the trainer, the loss, the dataset, the cache reader (``open_cache`` opens one), and the errors they raise,
every one a ``KdcacheError``. They load on first use (``kdcache.lazy_exports``), so ``import kdcache`` imports
neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.api import (
        ApiError as ApiError,
        Cache as Cache,
        CacheDataset as CacheDataset,
        open_cache as open_cache,
    )
    from kdcache.stages.train.core.checks import CacheCheckError as CacheCheckError
    from kdcache.stages.train.evaluation.evaluate import EvaluationError as EvaluationError
    from kdcache.stages.train.feed.streaming import DataPosition as DataPosition
    from kdcache.stages.train.hf_args import DistillationArguments as DistillationArguments
    from kdcache.stages.train.hf_trainer import CacheTrainer as CacheTrainer
    from kdcache.stages.train.loss import DistillationLoss as DistillationLoss
    from kdcache.stages.train.optimizer_step import TrainStep as TrainStep
    from kdcache.storage import (
        CacheReader as CacheReader,
        ChecksumError as ChecksumError,
        KdcacheError as KdcacheError,
        PartialCacheError as PartialCacheError,
    )
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)

__version__ = "0.1.0"
