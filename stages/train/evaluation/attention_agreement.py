"""Attention agreement in evaluation: the run's attention KL per (student block, teacher block) pair, whatever the
cache's attention source.

A maps cache is read as training reads it (the student's eager maps against ``attention/{t}``); a q/k cache through
the same recorder and blocked KL as training (the student keeps SDPA). Both give DESIGN's attention KL, so an
evaluation reads alike for both sources: ``attention: {"kl": mean over pairs, "pairs": {"s1_t2": ...},
"source": ...}``, each pair's KL averaged over the counted query rows of every batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kdcache.stages.targets import attention as attention_sources
from kdcache.stages.targets.attention.attention_maps import use_maps_attention
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.attention.qk_attention import QKRecorder
from kdcache.stages.targets.attention.qk_loss import cached_qk_loss
from kdcache.stages.train.core.layer_maps import Pair, pair_key
from kdcache.stages.train.core.masks import TokenMasks
from kdcache.stages.train.objective.compound import StudentOutput
from kdcache.stages.train.objective.distill import recorded

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.storage import CacheSpec


class AttentionAgreement:
    """Sums of the attention KL of each pair over an evaluation's batches (one-stream caches).

    Args:
        spec: the cache's spec (its ``attention_source`` and ``attention_scores``).
        pairs: the run's attention pairs whose teacher block is cached.
        student: the student; maps need its eager attention, a q/k cache records its queries and keys.
        causal: the student's causality.
    """

    def __init__(self, spec: CacheSpec, pairs: list[Pair], student: PreTrainedModel, causal: bool) -> None:
        self.source, self.scores = attention_sources.of(spec.attention_layout), spec.attention_scores
        self.pairs = pairs
        self.sums = dict.fromkeys((pair_key(p) for p in pairs), 0.0)
        self.rows = 0
        blocks = sorted({s for s, _ in pairs})
        self.recorder = QKRecorder(student, blocks, causal) if not self.source.student_maps and pairs else None
        if self.source.student_maps and pairs:
            use_maps_attention(student)  # fused kernels return no maps; eager's come after dropout

    @property
    def names(self) -> list[str]:
        """The cached arrays the pairs read."""
        kinds = self.source.stream_kinds("kl")
        return [f"{kind}/{t}" for t in sorted({t for _, t in self.pairs}) for kind in kinds]

    def forward(self, model: PreTrainedModel, inputs: Mapping[str, torch.Tensor], **kwargs: bool) -> StudentOutput:
        """The student's outputs, with its maps or its recorded ``attention_qkv`` when pairs need them."""
        if self.recorder is None:
            return model(**inputs, output_attentions=bool(self.pairs), **kwargs)
        return recorded(self.recorder, lambda: model(**inputs, **kwargs))

    def update(self, out: StudentOutput, batch: Mapping[str, torch.Tensor], masks: TokenMasks) -> None:
        """Add one batch: each pair's KL times the batch's counted query rows."""
        rows = int(masks.trained.sum())
        if not self.pairs or not rows:
            return
        for s, t in self.pairs:
            if self.recorder is None:
                value = attention_kl(out.attentions[s - 1], batch[f"attention/{t}"], masks.real, queries=masks.trained)
            else:
                value = cached_qk_loss("kl", out.attention_qkv[s], batch, t, self.scores or {}, masks.real,
                                       masks.trained)
            self.sums[pair_key((s, t))] += float(value) * rows
        self.rows += rows

    def result(self) -> dict[str, Any] | None:
        """``{"kl", "pairs", "source"}``, or None when the run has no attention pair in this cache."""
        if not self.pairs or not self.rows:
            return None
        pairs = {key: total / self.rows for key, total in self.sums.items()}
        return {"kl": sum(pairs.values()) / len(pairs), "pairs": pairs, "source": self.source.name}
