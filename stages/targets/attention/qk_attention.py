"""Queries and keys as a model computes them, and attention probabilities rebuilt from them, block by block.

Both stages use this module: stage one caches a teacher's per-head queries and keys (and values) instead of its
attention maps, and stage two takes the student's the same way and rebuilds both sides' probabilities for a block
of query rows at a time, so neither holds a ``[B, H, L, L]`` tensor.

The queries and keys are taken where every transformers 5 model hands them to its attention kernel:
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation)`` is called with ``query [B, H, L, d]``,
``key`` / ``value [B, H_kv, L, d]`` (rotary embeddings already applied, grouped-query keys once per key/value
head) and the ``scaling``, ``sliding_window`` and ``softcap`` the model adds to its scores. ``QKRecorder``
registers one more implementation under ``ATTENTION_NAME`` that records those arguments and delegates to SDPA
(soft-capped models, which SDPA refuses, to their own eager attention), so
the forward keeps its fused kernel (and its memory) while the recorder keeps references to q, k and v (with their
gradients, in stage two). Attention calls are numbered in the order they run: block j is the j-th call of a
forward, which holds for every one-stack model (decoder-only and encoder).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTENTION_NAME = "kdcache_qk"
CHECK_BLOCK = 128  # query rows rebuilt at a time by check_rule: a [1, H, 128, L] fp32 block
_ACTIVE: list[QKRecorder] = []  # the recorder of the forward running now (innermost last)
# transformers' attention interface: (module, query, key, value, mask, **settings) -> (output [B, L, H, d], weights)
AttentionFunction = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class ScoreRule:
    """How one block turns ``q·k`` into probabilities: ``softmax(cap(scaling · q·k) + mask)``.

    Attributes:
        scaling: the factor on ``q·k`` (``head_dim ** -0.5`` for most models; GPT-2 may divide by the layer).
        causal: whether a query attends only to keys at or before it.
        sliding_window: a query attends only to the last ``sliding_window`` keys (HF's rule), or None.
        softcap: scores become ``softcap · tanh(score / softcap)`` before the mask (Gemma 2), or None.
    """

    scaling: float
    causal: bool
    sliding_window: int | None = None
    softcap: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The per-block record of ``CacheSpec.attention_scores["blocks"]`` (causality is recorded once)."""
        return {"scaling": self.scaling, "sliding_window": self.sliding_window, "softcap": self.softcap}

    @classmethod
    def from_json(cls, block: dict[str, Any], causal: bool) -> ScoreRule:
        return cls(float(block["scaling"]), bool(causal), block.get("sliding_window"), block.get("softcap"))


@dataclass
class Captured:
    """One block's attention inputs: ``q [B, H, L, d]``, ``k`` and ``v [B, H_kv, L, d]`` (H a multiple of H_kv), its
    rule, and the delegate's output ``[B, L, H, d]`` (kept only while a recorder checks the rule). A side of the
    losses of ``qk_loss`` reads ``q``, ``k`` and ``rule`` alone (no ``v``: a teacher's from the cache)."""

    q: torch.Tensor
    k: torch.Tensor
    rule: ScoreRule
    v: torch.Tensor | None = None
    output: torch.Tensor | None = None


class QKRecorderError(RuntimeError):
    """A model's attention cannot be recorded or rebuilt from its queries and keys (caught and worded by callers)."""


def _delegate(module: torch.nn.Module, kwargs: dict[str, Any]) -> AttentionFunction:
    """SDPA; for soft-capped scores, which SDPA refuses, the model's own eager attention given an additive mask."""
    # Here, not at the top: transformers has it from 4.48 (pyproject allows 4.45), and only the qk source calls it.
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is None:
        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise QKRecorderError(f"{type(module).__name__} soft-caps its scores and has no eager attention to run")

    def run(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            **kw: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # SDPA's mask format: True = attend
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
        return eager(module, q, k, v, mask, **kw)
    return run


def _forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The registered attention function: SDPA, plus a record of its inputs when a recorder is active."""
    output = _delegate(module, kwargs)(module, query, key, value, attention_mask, **kwargs)
    if _ACTIVE:
        _ACTIVE[-1].add(module, query, key, value, kwargs, output[0])
    return output


class QKRecorder:
    """Records the queries, keys and values of chosen blocks of one model during ``with recorder.forward():``.

    Args:
        model: a transformers model; its attention implementation becomes ``ATTENTION_NAME`` (SDPA underneath).
        blocks: the block numbers (1..N) to keep.
        causal: the model's causality, used where an attention module does not say (``module.is_causal``).
        keep_output: also keep each block's attention output, to check the rebuilt scores (``check_rule``).
    """

    def __init__(self, model: PreTrainedModel, blocks: tuple[int, ...] | list[int], causal: bool,
                 keep_output: bool = False) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        # ATTENTION_NAME's attention function, and SDPA's mask format
        AttentionInterface.register(ATTENTION_NAME, _forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        model.set_attn_implementation(ATTENTION_NAME)
        self.blocks, self.causal, self.keep_output = set(blocks), causal, keep_output
        self.captured: dict[int, Captured] = {}
        self._calls = 0

    def forward(self) -> QKRecorder:
        """Use as ``with recorder.forward(): model(...)``; ``captured`` then holds this forward's blocks."""
        self.captured, self._calls = {}, 0
        return self

    def __enter__(self) -> QKRecorder:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.remove(self)

    def add(self, module: torch.nn.Module, q: torch.Tensor,
 k: torch.Tensor, v: torch.Tensor, kwargs: dict[str, Any],
            output: torch.Tensor) -> None:
        """Called by the attention function for every block, in order."""
        self._calls += 1
        if self._calls not in self.blocks:
            return
        if kwargs.get("s_aux") is not None:  # attention sinks add a column to the softmax that q and k do not give
            raise QKRecorderError(f"{type(module).__name__} adds attention sinks to its scores")
        scaling = kwargs.get("scaling")
        rule = ScoreRule(float(q.shape[-1] ** -0.5 if scaling is None else scaling),
                         bool(getattr(module, "is_causal", self.causal)), kwargs.get("sliding_window"),
                         kwargs.get("softcap"))
        self.captured[self._calls] = Captured(q, k, rule, v, output if self.keep_output else None)


def allowed_keys(mask: torch.Tensor, rows: slice, rule: ScoreRule,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query row of ``rows`` may attend: ``[B, 1, C, L]`` bool.

    A key is allowed when it is real (``mask``), in the query's document (``documents``: ``[B, L]`` document
    index of each token, for rows packed with documents kept apart), not later than the query when causal, and
    within the sliding window. A query row with no allowed key (padding) keeps its own position, so its softmax
    stays finite; no loss counts it.
    """
    length = mask.shape[1]
    q_idx = torch.arange(rows.start, rows.stop, device=mask.device)[:, None]
    k_idx = torch.arange(length, device=mask.device)[None, :]
    allowed = mask.bool()[:, None, :].expand(-1, q_idx.shape[0], -1)
    if documents is not None:
        allowed = allowed & (documents[:, rows, None] == documents[:, None, :])
    if rule.causal:
        allowed = allowed & (k_idx <= q_idx)
    if rule.sliding_window is not None:
        allowed = allowed & (k_idx > q_idx - int(rule.sliding_window))
    alone = ~allowed.any(-1, keepdim=True)
    return (allowed | (alone & (k_idx == q_idx)))[:, None]


def block_log_probs(q: torch.Tensor, k: torch.Tensor, rule: ScoreRule, allowed: torch.Tensor) -> torch.Tensor:
    """Attention log-probabilities of a block of queries, in float32.

    Args:
        q: ``[B, H, C, d]`` the block's queries.
        k: ``[B, H_kv, L, d]`` every key; query head h reads key head ``h // (H / H_kv)`` (transformers'
            ``repeat_kv`` order), grouped here without copying the keys.
        rule: the block's score rule.
        allowed: ``[B, 1, C, L]`` from ``allowed_keys``.

    Returns:
        ``[B, H, C, L]``; ``-inf`` at keys not allowed.
    """
    b, heads, rows, width = q.shape
    kv_heads = k.shape[1]
    grouped = q.float().reshape(b, kv_heads, heads // kv_heads, rows, width)
    scores = (grouped @ k.float()[:, :, None].transpose(-1, -2)).reshape(b, heads, rows, -1) * rule.scaling
    if rule.softcap is not None:
        scores = torch.tanh(scores / rule.softcap) * rule.softcap
    return torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def check_rule(captured: Captured, mask: torch.Tensor, documents: torch.Tensor | None, what: str,
               block: int = CHECK_BLOCK) -> None:
    """Refuse a block whose attention output is not ``softmax(rebuilt scores) · v``: the model adds something to
    its scores (a relative position bias, ALiBi, another mask) that its queries and keys do not carry.

    Only the batch's first sequence is checked, ``block`` query rows at a time: a bias shows in any sequence, and
    the whole batch's ``[B, H, L, L]`` fp32 maps would not fit on a GPU at long contexts.

    Args:
        captured: a block recorded with ``keep_output``.
        mask, documents: ``[B, L]`` the batch's real tokens and document index (or None).
        what: names the model and block in the message.
        block: query rows rebuilt at a time.
    """
    assert captured.output is not None and captured.v is not None
    q, k, v, rule = captured.q[:1], captured.k[:1], captured.v[:1].float(), captured.rule
    mask, documents = mask[:1], None if documents is None else documents[:1]
    output, real = captured.output[0].float(), mask[0].bool()  # [L, H, d] like the delegate's output
    gap, scale = 0.0, 1.0
    for start in range(0, q.shape[2], block):
        rows = slice(start, min(start + block, q.shape[2]))
        keep = real[rows]
        if not keep.any():
            continue
        probs = block_log_probs(q[:, :, rows], k, rule, allowed_keys(mask, rows, rule, documents)).exp()
        _, heads, count, length = probs.shape
        grouped = probs.reshape(1, v.shape[1], heads // v.shape[1], count, length) @ v[:, :, None]
        rebuilt = grouped.reshape(heads, count, -1).transpose(0, 1)[keep]  # [C', H, d]
        want = output[rows][keep]
        gap = max(gap, float((rebuilt - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    tolerance = 1e-3 if q.dtype == torch.float32 else 3e-2
    if gap > tolerance * scale:
        raise QKRecorderError(f"{what}: its attention output differs by {gap:.3g} from softmax(scaling * q.k + "
                              f"causal/padding/document/window masks) . v, so something else is added to its "
                              f"scores (a relative position bias, ALiBi)")
