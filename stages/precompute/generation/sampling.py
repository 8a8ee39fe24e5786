"""The teacher's next tokens, drawn so that a response depends only on (seed, prompt, response number).

Each response has its own generator (``RowDraws``), seeded from those three numbers, from which it draws one
uniform per token: the batch it shares, its row in it, the rank that runs it and the point a killed run resumed
from change nothing. A token is then the inverse of the filtered distribution's CDF at that uniform: the
temperature divides the raw logits, ``top_k`` keeps the k most likely tokens and ``top_p`` the fewest most likely
whose probability reaches p (the first always stays), as Hugging Face's warpers do. Temperature 0 is greedy.
"""

from __future__ import annotations

import hashlib

import torch

from kdcache.stages.precompute.generation.options import Sampling


def response_seed(seed: int, prompt: int, response: int, purpose: str = "tokens") -> int:
    """A 63-bit seed for one response's draws of one purpose (its tokens, or a logit kind's samples)."""
    digest = hashlib.sha256(f"kdcache-generate/{purpose}/{seed}/{prompt}/{response}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RowDraws:
    """One uniform per generated token for each response of a batch, from each response's own generator.

    Args:
        keys: per row, its (prompt index, response number).
        seed: the run's ``--seed``.
    """

    def __init__(self, keys: list[tuple[int, int]], seed: int) -> None:
        self.generators = [torch.Generator().manual_seed(response_seed(seed, p, r)) for p, r in keys]

    def uniforms(self, rows: list[int]) -> torch.Tensor:
        """``[len(rows)]`` float64 uniforms in [0, 1), the next draw of each of ``rows`` (host tensors: CPU
        generators give the same numbers on every machine)."""
        return torch.cat([torch.rand(1, generator=self.generators[i], dtype=torch.float64) for i in rows])


def next_tokens(logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row.

    Args:
        logits: ``[B, V]`` the raw logits of the last position (before any processor).
        sampling: temperature, top-k and top-p.
        uniforms: ``[B]`` float64 draws (``RowDraws.uniforms``); None when greedy.

    Returns:
        ``[B]`` int64 token ids on the logits' device.
    """
    if sampling.greedy or uniforms is None:
        return logits.argmax(-1)
    ordered, order = (logits.double() / sampling.temperature).sort(dim=-1, descending=True, stable=True)
    probs = ordered.softmax(-1)
    if sampling.top_k:
        probs[:, sampling.top_k:] = 0
        probs = probs / probs.sum(-1, keepdim=True)  # top-p then reads the kept tokens' own distribution
    if sampling.top_p < 1:
        before = probs.cumsum(-1) - probs  # the mass of the more likely tokens: the first token always stays
        probs = probs.masked_fill(before >= sampling.top_p, 0)
    cdf = probs.cumsum(-1)
    target = uniforms.to(cdf.device)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, picked).squeeze(-1)
