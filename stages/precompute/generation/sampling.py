"""The teacher's next tokens, drawn so that a response depends only on (seed, prompt, response number).

A response's t-th token is drawn with one uniform that is a pure function of (seed, prompt, response number, t):
Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator,
run on the counter (t, draw, response, prompt) under the key (the seed's two 32-bit halves). Nothing is carried
between draws, so the batch a response shares, its row in it, the rank that runs it and the point a killed run
resumed from change nothing; and a whole batch's draws are a few tensor ops on the logits' device instead of one
generator call per row and step. The integer arithmetic is exact on every device: words are kept in int64 tensors
as values in [0, 2^32), and 32 x 32-bit products are taken in 16-bit halves, so no intermediate passes 2^49 (no
signed overflow, and every right shift is of a non-negative value).

A token is then the inverse of the filtered distribution's CDF at its uniform: the temperature divides the raw
logits, ``top_k`` keeps the k most likely tokens and ``top_p`` the fewest most likely whose probability reaches p
(the first always stays), as Hugging Face's warpers do. Temperature 0 is greedy. ``options.SAMPLER`` names this
rule and is recorded with the generation settings, so a cache another sampler began is not resumed with this one.
"""

from __future__ import annotations

import hashlib

import torch

from kdcache.stages.precompute.generation.options import Sampling

MASK32 = 0xFFFFFFFF
PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # the round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # the key's bump per round (golden ratio, sqrt(3) - 1)
PHILOX_ROUNDS = 10
TOKEN_DRAW = 0  # the counter's draw word for the tokens (another purpose takes another number)
STEPS_AT_ONCE = 64  # decode steps whose uniforms one call computes (the hash then costs ~1/64 of a call a step)


def response_seed(seed: int, prompt: int, response: int, purpose: str = "tokens") -> int:
    """A 63-bit seed of one response's torch generator for one purpose (a logit kind's samples)."""
    digest = hashlib.sha256(f"kdcache-generate/{purpose}/{seed}/{prompt}/{response}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _mul_hi_lo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``a * m`` for int64 ``a`` in [0, 2^32) and a 32-bit constant ``m``;
    ``m`` is split into 16-bit halves so that every product stays below 2^48 (exact in int64)."""
    low, high = a * (m & 0xFFFF), a * (m >> 16)  # a * m = high * 2^16 + low
    folded = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (folded >> 32), folded & MASK32


def philox(counter: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
    """Philox-4x32-10 of ``[N, 4]`` int64 counters (words in [0, 2^32)) under a 2-word key.

    Returns:
        ``[N, 4]`` int64 random words in [0, 2^32), on the counters' device.
    """
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mul_hi_lo(c0, PHILOX_M[0])
        hi1, lo1 = _mul_hi_lo(c2, PHILOX_M[1])
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W[0]) & MASK32, (k1 + PHILOX_W[1]) & MASK32
    return torch.stack([c0, c1, c2, c3], dim=-1)


def uniforms(seed: int, keys: torch.Tensor, steps: range, draw: int = TOKEN_DRAW) -> torch.Tensor:
    """The uniforms of ``steps`` for each response in ``keys``.

    Args:
        seed: the run's ``--seed`` (its 64 bits are the key).
        keys: ``[B, 2]`` int64 (prompt index, response number) per row, on the device the draws are wanted on.
        steps: the token numbers (decode steps) wanted.
        draw: the counter's draw word (which purpose the draws serve).

    Returns:
        ``[B, len(steps)]`` float64 in [0, 1) with 53 random bits each (the first two words of each counter's
        output; the 53-bit integer is exact in float64).
    """
    b, t = keys.shape[0], len(steps)
    step = torch.arange(steps.start, steps.stop, dtype=torch.int64, device=keys.device)
    counter = torch.stack([step.expand(b, t), torch.full((b, t), draw, dtype=torch.int64, device=keys.device),
                           keys[:, 1:2].expand(b, t), keys[:, 0:1].expand(b, t)], dim=-1)
    key = (seed & MASK32, (seed >> 32) & MASK32)
    words = philox(counter.reshape(-1, 4) & MASK32, key)
    bits = ((words[:, 0] >> 5) << 26) + (words[:, 1] >> 6)  # 27 + 26 bits: an integer in [0, 2^53)
    return (bits.double() * 2.0**-53).view(b, t)


class ResponseDraws:
    """The token uniforms of one batch's responses, computed ``STEPS_AT_ONCE`` decode steps at a time.

    Args:
        keys: per row, its (prompt index, response number).
        seed: the run's ``--seed``.
        device: where the draws are used (the logits' device).
    """

    def __init__(self, keys: list[tuple[int, int]], seed: int, device: torch.device) -> None:
        self.keys = torch.tensor(keys, dtype=torch.int64, device=device).view(-1, 2)
        self.seed = seed
        self._block, self._first = self.keys.new_empty((0, 0), dtype=torch.float64), 0

    def at(self, step: int) -> torch.Tensor:
        """``[B]`` float64 uniforms of every row's token number ``step``."""
        if not self._first <= step < self._first + self._block.shape[1]:
            self._first = step
            self._block = uniforms(self.seed, self.keys, range(step, step + STEPS_AT_ONCE))
        return self._block[:, step - self._first]


def next_tokens(logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None) -> torch.Tensor:
    """The next token of each row.

    Args:
        logits: ``[B, V]`` the raw logits of the last position (before any processor).
        sampling: temperature, top-k and top-p.
        uniforms: ``[B]`` float64 draws (``ResponseDraws.at``) on the logits' device; None when greedy.

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
    target = uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, picked).squeeze(-1)
