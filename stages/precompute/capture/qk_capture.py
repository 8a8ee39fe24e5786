"""Stage one's side of ``--attention-source qk|qkv``: the teacher's queries, keys and values as token rows.

``targets.attention.qk_attention.QKRecorder`` records what each selected block hands its attention kernel; here that
becomes storage-ready arrays, ``attention_q/{j} [B, L, H * d]`` and ``attention_k/{j}`` / ``attention_v/{j}
[B, L, H_kv * d]`` (padded like hidden states; ``transfer.cut_padding`` cuts them per sequence), and the score rule
of every block is learnt once, from a probe forward, before the cache's spec is written. That probe and the first
batch also check that the rebuilt scores reproduce the teacher's attention output (``qk_attention.check_rule``):
a model that adds anything else to its scores is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kdcache.stages.common.documents import document_index
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.targets import Targets
from kdcache.stages.targets.attention.qk_attention import QKRecorder, QKRecorderError, check_rule
from kdcache.storage import DEFAULT_ATTENTION_SOURCE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.stages.precompute.rows.data import TokenStreams

PROBE_TOKENS = 64  # tokens of the first row the probe forward runs on
Result = TypeVar("Result")


class QKCapture:
    """Records the selected blocks' q/k/v of one teacher and turns them into padded token rows.

    Args:
        model: the teacher (any attention implementation; SDPA runs underneath the recorder).
        targets: what to keep (an ``attention_source`` of token rows, the blocks of stream ``""``).
    """

    def __init__(self, model: PreTrainedModel, targets: Targets) -> None:
        self.model, self.targets = model, targets
        self.kinds = targets.attention.source.recorded_parts
        self.flag = f"--attention-source {targets.attention.name}"
        self.fallback = f"use --attention-source {DEFAULT_ATTENTION_SOURCE}"
        self.recorder = QKRecorder(model, targets.streams[""].attention, targets.causal, keep_output=True)

    def run(self, forward: Callable[[], Result], attention_mask: torch.Tensor,
            position_ids: torch.Tensor | None) -> Result:
        """Call ``forward()`` while recording; the first call also checks every block's rebuilt scores."""
        try:
            with self.recorder.forward():
                result = forward()
        except QKRecorderError as exc:  # raised inside the forward: attention sinks, soft-capping without eager
            raise PrecomputeError(f"{self.flag}: {exc}, so its attention cannot be rebuilt from queries and keys; "
                                  f"{self.fallback}") from None
        if self.recorder.keep_output:
            documents = None if position_ids is None else document_index(position_ids)
            self._check(attention_mask, documents)
            self.recorder.keep_output = False  # checked once: the outputs are not kept again
        return result

    def _check(self, attention_mask: torch.Tensor, documents: torch.Tensor | None) -> None:
        missing = sorted(set(self.targets.streams[""].attention) - set(self.recorder.captured))
        name = type(self.model).__name__
        if missing:
            raise PrecomputeError(f"{self.flag}: {name} does not compute blocks {missing} through transformers' "
                                  f"attention interface, so their queries and keys cannot be taken; {self.fallback}")
        for j, captured in self.recorder.captured.items():
            try:
                check_rule(captured, attention_mask, documents, f"{name} block {j}")
            except QKRecorderError as exc:
                raise PrecomputeError(f"{self.flag}: {exc}; stage two could not rebuild its attention, "
                                      f"{self.fallback}") from None

    def arrays(self, last: int | None = None) -> dict[str, torch.Tensor]:
        """The last forward's ``attention_{q,k,v}/{j} [B, L, heads * d]`` (head-major within a token's row).

        Args:
            last: keep only the last ``last`` positions: a forward with a KV cache hands the kernel every earlier
                step's keys and values too, and only its own ``last`` tokens are new (generation's decode steps).
        """
        out = {}
        for j, captured in self.recorder.captured.items():
            for kind in self.kinds:
                x = getattr(captured, kind)  # [B, heads, L, d]
                x = x if last is None else x[:, :, -last:]
                out[f"attention_{kind}/{j}"] = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
        self.recorder.captured = {}
        return out

    def score_record(self, input_ids: torch.Tensor) -> dict[str, Any]:
        """``CacheSpec.attention_scores``: a probe forward on ``input_ids [1, L]`` (checked like a batch) gives
        each block's score rule and the head counts."""
        mask = torch.ones_like(input_ids)
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask}
        if self.targets.causal:
            kwargs["use_cache"] = False
        with torch.inference_mode():
            self.run(lambda: self.model(**kwargs), mask, None)
        captured = self.recorder.captured
        self.recorder.captured, self.recorder.keep_output = {}, True  # the first real batch is checked as well
        first = captured[min(captured)]
        return {"num_heads": int(first.q.shape[1]), "num_kv_heads": int(first.k.shape[1]),
                "head_dim": int(first.q.shape[-1]), "causal": bool(first.rule.causal),
                "blocks": {str(j): c.rule.to_json() for j, c in sorted(captured.items())}}


def with_score_rules(targets: Targets, model: PreTrainedModel, data: TokenStreams, device: torch.device) -> Targets:
    """``targets`` with the attention settings' score rules (``CacheSpec.attention_scores``) learnt from the loaded
    teacher, for a source of token rows; else unchanged."""
    recorded = targets.attention.source.recorded_parts
    if not recorded or "" not in targets.streams or not targets.streams[""].attention:
        return targets
    # the probe: [1, PROBE_TOKENS] at most, the first tokens of the first row (a real text, as the teacher reads);
    # a copy, as the row is a read-only memory map
    ids = torch.from_numpy(np.array(data.ids[""][0][:PROBE_TOKENS], dtype=np.int64)).to(device)[None]
    record = QKCapture(model, targets).score_record(ids)
    return replace(targets, attention=replace(targets.attention, scores=record))
