"""``--attention-source qk``: each block's queries (after rotary embeddings) and keys (once per key/value head) as
token rows ``[T, heads * head_dim]``; stage two rebuilds the teacher's scores block by block from them and the
spec's ``attention_scores``, against the student's recorded queries and keys."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from kdcache.stages.targets.attention.base import AttentionSource, config_heads, register
from kdcache.storage import DEFAULT_ATTENTION_SOURCE, QK_LAYOUT

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kdcache.storage import CacheSpec


@register
class QK(AttentionSource):
    layout = QK_LAYOUT
    summary = ("its queries after rotary embeddings and its keys once per key/value head: (H + H_kv) x head_dim "
               "values per token whatever L; stage two rebuilds the maps block by block")

    def teacher_problems(self, teacher: str, config: PretrainedConfig, streams: Collection[str], triangle: bool,
                         heads: tuple[int, ...] | None) -> list[str]:
        """Rows are for one token stream, every head, no triangle; T5's relative position bias, added to its
        scores inside the model, could not be rebuilt from them."""
        flag, default = f"--attention-source {self.name}", DEFAULT_ATTENTION_SOURCE
        if "" not in streams:
            bias = " (its relative position bias is added to the scores inside the model)" \
                if getattr(config, "relative_attention_num_buckets", None) else ""
            return [f"{flag}: not for encoder-decoder teachers such as {teacher!r} ({config.model_type}){bias}; "
                    f"use --attention-source {default}"]
        if triangle or heads is not None:
            return [f"{flag}: drop --triangle and --heads (queries and keys are stored per token for every head; "
                    f"their size does not grow with the context)"]
        return []

    def estimate_bytes(self, spec: CacheSpec, name: str, config: PretrainedConfig, tokens: int, sum_sq: int,
                       item: int) -> int:
        """``tokens x (H + H_kv) x head_dim`` values per block, plus ``H_kv x head_dim`` per stored value row."""
        heads = config_heads(config)
        d = int(getattr(config, "hidden_size", None) or 0)
        head_dim = int(getattr(config, "head_dim", None) or (d // heads if heads else 0))
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        widths = {"q": heads, "k": kv_heads, "v": kv_heads}
        return tokens * sum(widths[part] for part in self.recorded_parts) * head_dim * item

    def stream_kinds(self, attention_loss: str) -> tuple[str, ...]:
        """Queries and keys for the KL; every stored kind (values too, when kept) for the relation loss."""
        kinds = self.layout.kinds
        return kinds if attention_loss == "relation" else kinds[:2]

    def teacher_heads(self, scores: Mapping[str, Any] | None, stored: int | None) -> int | None:
        """The query heads of the score record."""
        return int(scores["num_heads"]) if scores else None

    def describe(self, info: Mapping[str, Any]) -> str:
        scores = info.get("attention_scores") or {}
        return (f", stored as {self.name} ({scores.get('num_heads')} query heads, {scores.get('num_kv_heads')} "
                f"key/value heads of {scores.get('head_dim')})")


