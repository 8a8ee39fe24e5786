"""Stage two's ground floor: what every part of it reads and nothing of it below: the options (``options``), the
layer maps (``layer_maps``), the student and its facts (``student``, ``student_head``), which tokens each term
counts (``masks``), and the plan they resolve to against the cache (``plan``, with its checks: ``checks``,
``cross_checks``), which raises ``CacheCheckError``.

The floors above import it through this door, each only those below it: ``losses`` (every loss by name),
``objective`` (the loss of a run over its streams and the student's forward under it), ``cross`` (a student with
its own tokenizer), ``evaluation`` (scores against a cache), and the modules of ``train`` itself, which run the
loop (``loop``, ``api``, ``hf_trainer``, ``engine``, ``checkpoint``...). ``feed`` stands beside them, on nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.train.core.checks import (
        CacheCheckError as CacheCheckError,
        open_cache as open_cache,
        stream_problems as stream_problems,
        vocab_problems as vocab_problems,
    )
    from kdcache.stages.train.core.cross_checks import text_problems as text_problems
    from kdcache.stages.train.core.layer_maps import (
        LayerMap as LayerMap,
        LayerMapError as LayerMapError,
        Pair as Pair,
        build_layer_map as build_layer_map,
        pair_key as pair_key,
    )
    from kdcache.stages.train.core.masks import (
        TokenMasks as TokenMasks,
        stream_masks as stream_masks,
        token_masks as token_masks,
    )
    from kdcache.stages.train.core.options import (
        DEFAULT_TEMPERATURE as DEFAULT_TEMPERATURE,
        LossOptions as LossOptions,
        MapOptions as MapOptions,
        TrainOptions as TrainOptions,
        resolved_temperature as resolved_temperature,
    )
    from kdcache.stages.train.core.plan import (
        StreamPairs as StreamPairs,
        TrainPlan as TrainPlan,
        plan_training as plan_training,
        unused_targets as unused_targets,
    )
    from kdcache.stages.train.core.student import (
        ADAPTER_CONFIG as ADAPTER_CONFIG,
        StudentError as StudentError,
        StudentFacts as StudentFacts,
        copy_tokenizer_files as copy_tokenizer_files,
        enable_gradient_checkpointing as enable_gradient_checkpointing,
        has_weights as has_weights,
        load_config as load_config,
        load_student as load_student,
        student_facts as student_facts,
        tokenizer_fingerprint_of as tokenizer_fingerprint_of,
    )
    from kdcache.stages.train.core.student_head import base_forward as base_forward, choose_head as choose_head
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
