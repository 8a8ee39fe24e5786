"""The EAGLE-3 draft head: an fc over three fused target layers, one decoder layer, and a reduced-vocabulary head.

Inputs per position t: the target's hidden states of three layers ``[3d]`` (low, middle, high), fused by ``fc`` to
``[d]``, and the frozen target embedding of the next token ``x_{t+1}``. The decoder layer attends over
``[norm(embedding); norm(feature)]`` (``2d`` wide) and its output predicts ``x_{t+2}`` over the N draft tokens.

Training-time test (EAGLE-3): step k feeds the layer its own step k-1 output instead of the target's feature, with
the token k places on. A step-k query at position t sees the step-0 keys of positions <= t and, of every later
step j <= k, only its own position's key (what it would have seen at inference, drafting k tokens past t). The
rotary position of step k at t is t + k. Inference runs the same steps on the last position only, over a key/value
cache (transformers' ``DynamicCache``, one layer) instead of ``Past``: step 0's keys of the context positions, then
one key per drafted token; for a single query that is the same layout, and decoding crops the drafted keys off.

Parameter names follow speculators' ``Eagle3Speculator`` (``fc``, ``layers.0.*``, ``norm``, ``lm_head``, ``d2t``,
``t2d``), which vLLM also reads; ``export`` writes them as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass(frozen=True)
class DraftShape:
    """The draft's sizes. ``layers``: the target's fused hidden layers (HF numbering, 0 = embeddings)."""

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    num_heads: int
    intermediate_size: int
    layers: tuple[int, int, int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "layers": list(self.layers)}


def default_heads(hidden: int) -> int:
    """Attention heads for a draft of width ``hidden``: head size 64 where it divides (128 from 2048 on, as the
    Llama family), else 8, else one head."""
    for size in (128, 64, 8) if hidden >= 2048 else (64, 8):
        if hidden % size == 0 and hidden >= size:
            return hidden // size
    return 1


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 at least (float64 stays float64)."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [B, H, S, hd]`` at ``positions [S]`` (halves rotated, as Llama)."""
    half, wide = x.shape[-1] // 2, torch.promote_types(x.dtype, torch.float32)
    freqs = 1.0 / theta ** (torch.arange(half, device=x.device, dtype=wide) / half)
    angles = positions.to(wide)[:, None] * freqs[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(x.dtype), torch.cat([angles.sin()] * 2, -1).to(x.dtype)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


Past = list[tuple[torch.Tensor, torch.Tensor]]  # keys and values [B, H, S, hd] of each earlier step, step 0 first


class DraftAttention(nn.Module):
    """Self-attention over the ``2d``-wide input, with the training-time-test key layout (module docstring)."""

    def __init__(self, shape: DraftShape):
        super().__init__()
        d, inner = shape.hidden_size, shape.num_heads * shape.head_dim
        self.q_proj = nn.Linear(2 * d, inner, bias=False)
        self.k_proj = nn.Linear(2 * d, inner, bias=False)
        self.v_proj = nn.Linear(2 * d, inner, bias=False)
        self.o_proj = nn.Linear(inner, d, bias=False)
        self.heads, self.head_dim, self.theta = shape.num_heads, shape.head_dim, shape.rope_theta

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:2], self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past: Past | DynamicCache) -> torch.Tensor:
        """``x [B, S, 2d]`` at rotary ``positions [S]`` -> ``[B, S, d]``; this step's keys join ``past`` (a list:
        the training layout; a cache: inference's, causal over everything cached)."""
        q = _rotate(self._split(self.q_proj(x)), positions, self.theta)
        k = _rotate(self._split(self.k_proj(x)), positions, self.theta)
        v = self._split(self.v_proj(x))
        out = self._over_steps(q, k, v, past) if isinstance(past, list) else self._over_cache(q, k, v, past)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        wide = torch.promote_types(scores.dtype, torch.float32)
        return torch.softmax(scores / self.head_dim ** 0.5, dim=-1, dtype=wide).to(scores.dtype)

    def _over_steps(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: Past) -> torch.Tensor:
        """Training-time-test attention, ``q, k, v [B, H, S, hd]`` -> ``[B, H, S, hd]``."""
        past.append((k, v))
        k0, v0 = past[0]
        s, s0 = q.shape[2], k0.shape[2]
        scores = [q @ k0.transpose(-1, -2)]  # [B, H, S, S0]
        # Causal over step 0: query i (the last s of s0 positions) sees keys up to its own position.
        scores[0] = scores[0].masked_fill(~_causal(s, s0, q.device), torch.finfo(scores[0].dtype).min)
        scores += [(q * kj).sum(-1, keepdim=True) for kj, _ in past[1:]]  # later steps: own position only
        weights = self._softmax(torch.cat(scores, -1))
        out = weights[..., :s0] @ v0
        for j, (_, vj) in enumerate(past[1:]):
            out = out + weights[..., s0 + j, None] * vj
        return out

    def _over_cache(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        """Inference: the S new positions join the cache and each sees the cached keys and the new ones up to
        itself, ``[B, H, S, hd]``."""
        keys, values = cache.update(k, v, 0)
        scores = q @ keys.transpose(-1, -2)
        scores = scores.masked_fill(~_causal(q.shape[2], keys.shape[2], q.device), torch.finfo(scores.dtype).min)
        return self._softmax(scores) @ values


def _causal(s: int, n: int, device: torch.device) -> torch.Tensor:
    """``[s, n]`` bool: query i, the (n - s + i)-th of n positions, may see key j <= n - s + i."""
    return torch.arange(n, device=device)[None, :] <= torch.arange(n - s, n, device=device)[:, None]


class DraftMLP(nn.Module):
    """SwiGLU, as Llama."""

    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """The one decoder layer: attention over ``[input_layernorm(embedding); hidden_norm(feature)]``, the residual
    taken on the feature before its norm (speculators' ``norm_before_residual: false``), then the MLP."""

    def __init__(self, shape: DraftShape):
        super().__init__()
        d, eps = shape.hidden_size, shape.rms_norm_eps
        self.input_layernorm, self.hidden_norm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.self_attn = DraftAttention(shape)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.mlp = DraftMLP(d, shape.intermediate_size)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                past: Past | DynamicCache) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, positions, past)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """The draft (module docstring).

    Args:
        shape: its sizes.
        embedding: the target's input embedding ``[V, d]``, kept frozen.
        d2t: ``[N]`` int64 offsets, draft index i is target id ``i + d2t[i]``.
        t2d: ``[V]`` bool, which target ids the draft vocabulary holds.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor
    embedding: torch.Tensor

    def __init__(self, shape: DraftShape, embedding: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        d = shape.hidden_size
        self.shape = shape
        # Frozen and read from the cache (or the target) on every load: a buffer left out of the state dict, so
        # neither a checkpoint nor the export carries the target's [V, d] (2 GiB in float32 at V = 128k, d = 4096).
        self.register_buffer("embedding", embedding.float(), persistent=False)
        self.fc = nn.Linear(3 * d, d, bias=False)
        self.layers = nn.ModuleList([DraftLayer(shape)])
        self.norm = RMSNorm(d, shape.rms_norm_eps)
        self.lm_head = nn.Linear(d, shape.draft_vocab_size, bias=False)
        self.register_buffer("d2t", d2t.to(torch.int64))
        self.register_buffer("t2d", t2d.to(torch.bool))

    @property
    def target_ids(self) -> torch.Tensor:
        """``[N]`` the target id of each draft index."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """``[B, S, 3d]`` target features -> ``[B, S, d]``."""
        return self.fc(features.to(self.fc.weight.dtype))

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             past: Past | DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: target ids ``tokens [B, S]`` and features ``hidden [B, S, d]`` at ``positions [S]`` ->
        ``(hidden [B, S, d], logits [B, S, N])``; ``past`` (a list of steps, or an inference cache) gains this
        step's keys."""
        out = self.layers[0](F.embedding(tokens, self.embedding), hidden, positions, past)
        return out, self.lm_head(self.norm(out))

    def unrolled(self, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test: ``features [B, L, 3d]``, ``ids [B, L]`` -> per step k the logits ``[B, L, N]`` that
        position t gives for token ``x_{t+2+k}``, fed ``x_{t+1+k}`` (zero past the end) and its own step k-1
        output."""
        hidden, length = self.fuse(features), ids.shape[1]
        past: Past = []
        out = []
        for k in range(steps):
            tokens = F.pad(ids[:, 1 + k:], (0, min(1 + k, length)))[:, :length]
            positions = torch.arange(length, device=ids.device) + k
            hidden, logits = self.step(tokens, hidden, positions, past)
            out.append(logits)
        return out
