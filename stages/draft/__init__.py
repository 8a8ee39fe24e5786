"""A speculative-decoding draft from the same cache: an EAGLE-3 head trained from cached target features
(``training``), judged by speculative decoding with the target (``decoding``, ``drafters``, ``evaluation``), and
exported where vLLM, SGLang and speculators load it (``export``).

This is the draft's front door: ``pipeline`` imports from ``kdcache.stages.draft`` only. It reads the cache through
stage two's feed and engine (``kdcache.stages.train``) and what stage one stored for it
(``kdcache.stages.common.draft_inputs``). Names load on first use (``kdcache.lazy_exports``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kdcache.lazy_exports import attach

if TYPE_CHECKING:
    from kdcache.stages.draft.decoding import (
        Generation as Generation,
        Proposal as Proposal,
        Recompute as Recompute,
        Sampling as Sampling,
        Target as Target,
        TargetPass as TargetPass,
        acceptance as acceptance,
        speculative_generate as speculative_generate,
        target_generate as target_generate,
    )
    from kdcache.stages.draft.drafters import (
        Eagle3Drafter as Eagle3Drafter,
        HFTarget as HFTarget,
        ModelDrafter as ModelDrafter,
        PromptLookup as PromptLookup,
        hf_target as hf_target,
    )
    from kdcache.stages.draft.evaluation import (
        EvalOptions as EvalOptions,
        evaluate_drafts as evaluate_drafts,
        format_report as format_report,
    )
    from kdcache.stages.draft.export import export_draft as export_draft, load_draft as load_draft
    from kdcache.stages.draft.model import DraftShape as DraftShape, Eagle3Draft as Eagle3Draft
    from kdcache.stages.draft.training import DraftOptions as DraftOptions, run_draft as run_draft
    from kdcache.stages.draft.vocab import DraftInputError as DraftInputError, DraftVocab as DraftVocab
else:  # mypy reads the names above and nothing else; at run time each loads on first use
    __getattr__, __dir__, __all__ = attach(__name__, __file__)
