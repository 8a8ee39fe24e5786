"""Speculative decoding with chain drafts: a drafter proposes up to K tokens, the target checks them in one pass.

Greedy: a draft token is kept while it equals the target's argmax; the target's own argmax follows the first
mismatch (or the last kept token), so the output is exactly the target's greedy decoding whatever the draft.

Sampled (the standard rule, Leviathan et al. 2023; Chen et al. 2023): draft token x, drawn from q, is kept with
probability ``min(1, p(x) / q(x))``; at the first rejection the next token is drawn from ``norm(max(0, p - q))``,
and after K kept tokens from p. Every emitted token then follows the target's distribution p (at the same
temperature). A drafter that proposes deterministically (prompt lookup, a greedy draft) has q one-hot on x.

The target is a ``Target``: a session over one sequence that keeps its key/value cache. ``start`` runs the prompt
(the prefill), ``extend`` runs tokens after the cached ones, each giving logits ``[S, V]`` and, for an EAGLE-3
drafter, the fused layers' features ``[S, F]`` of the positions it ran; ``crop`` drops the cache past a length (the
rejected draft tokens). A round verifies a chain of K drafted tokens in one target pass over K+1 positions; the
target alone runs one position per pass over the same kind of cache, so a speed-up is measured against the target
as it would serve without a draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch


class TargetPass(NamedTuple):
    logits: torch.Tensor  # [S, V] of the positions run
    features: torch.Tensor | None  # [S, F] or None


class Target(Protocol):
    """The target as decoding drives it (module docstring); a new ``start`` begins a new sequence."""

    def start(self, prompt: torch.Tensor) -> TargetPass: ...

    def extend(self, tokens: torch.Tensor) -> TargetPass: ...

    def crop(self, length: int) -> None: ...


class Proposal(NamedTuple):
    tokens: torch.Tensor  # [k'] int64, k' <= K (0: nothing to propose)
    q: torch.Tensor | None  # [k', V] the draft's distributions, or None: each token proposed with certainty


@dataclass
class Sampling:
    """``temperature`` 0: greedy; else sampled at that temperature from ``generator``."""

    temperature: float = 0.0
    generator: torch.Generator = field(default_factory=torch.Generator)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``softmax(logits / T)`` in float64, ``[..., V]``."""
        return torch.softmax(logits.double() / self.temperature, dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One id from ``probs [V]``."""
        return int(torch.multinomial(probs.double().cpu(), 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The next id from ``logits [V]`` and the distribution drawn from (None when greedy)."""
        if self.greedy:
            return int(logits.argmax()), None
        probs = self.probs(logits)
        return self.draw(probs), probs


class Drafter(Protocol):
    """Proposes draft tokens for a context: ``ids [T]``, the target's ``features [T-1, F]`` of every position
    but the last (whose token the target has just emitted), or None."""

    name: str

    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal: ...


def verify(proposal: Proposal, logits: torch.Tensor, sampling: Sampling) -> tuple[int, int]:
    """The target's verdict on a proposal: ``logits [k'+1, V]`` at the positions that predict each draft token and
    the one after -> (tokens kept, the target's next token)."""
    tokens = proposal.tokens.tolist()
    if sampling.greedy:
        best = logits.argmax(-1).tolist()
        kept = next((i for i, t in enumerate(tokens) if t != best[i]), len(tokens))
        return kept, best[kept]
    p = sampling.probs(logits)
    for i, x in enumerate(tokens):
        q_x = 1.0 if proposal.q is None else float(proposal.q[i, x])
        if float(torch.rand((), dtype=torch.float64, generator=sampling.generator)) * q_x < float(p[i, x]):
            continue  # kept with probability min(1, p/q)
        q = torch.zeros_like(p[i]) if proposal.q is None else proposal.q[i].to(p)
        if proposal.q is None:
            q[x] = 1.0
        residual = (p[i] - q).clamp(min=0)
        return i, sampling.draw(residual / residual.sum() if residual.sum() > 0 else p[i])
    return len(tokens), sampling.draw(p[len(tokens)])


@dataclass
class Generation:
    """What one prompt produced: ``tokens`` (new ids), per round ``(proposed, kept)``, and wall-clock seconds."""

    tokens: list[int]
    rounds: list[tuple[int, int]]
    seconds: float


def speculative_generate(target: Target, drafter: Drafter, prompt: torch.Tensor, max_new: int, k: int,
                         sampling: Sampling) -> Generation:
    """Generate ``max_new`` tokens after ``prompt [T0]`` with ``drafter`` proposing up to ``k`` per round."""
    start = time.perf_counter()
    first = target.start(prompt)
    token, _ = sampling.pick(first.logits[-1])
    ids, features = torch.cat([prompt, prompt.new_tensor([token])]), first.features
    rounds: list[tuple[int, int]] = []
    while ids.shape[0] - prompt.shape[0] < max_new:
        room = max_new - (ids.shape[0] - prompt.shape[0]) - 1  # the target adds one token of its own
        proposal = drafter.propose(ids, features, min(k, room), sampling)
        kept, token, seen = _check(target, ids, proposal, sampling)
        rounds.append((int(proposal.tokens.shape[0]), kept))
        ids = torch.cat([ids, proposal.tokens[:kept].to(ids), ids.new_tensor([token])])
        features = None if features is None or seen is None else torch.cat([features, seen])
    return Generation(ids[prompt.shape[0]:].tolist(), rounds, time.perf_counter() - start)


def _check(target: Target, ids: torch.Tensor, proposal: Proposal, sampling: Sampling
           ) -> tuple[int, int, torch.Tensor | None]:
    """One target pass over the context's last token (not yet run: the target emitted it) and the ``k'`` drafted
    ones -> (tokens kept, the target's next token, features ``[kept + 1, F]`` of the positions now in the
    context). The cache keeps the context's positions only: the rejected tokens are cropped off."""
    checked = target.extend(torch.cat([ids[-1:], proposal.tokens.to(ids)]))
    kept, token = verify(proposal, checked.logits, sampling)
    target.crop(ids.shape[0] + kept)
    return kept, token, None if checked.features is None else checked.features[:kept + 1]


def target_generate(target: Target, prompt: torch.Tensor, max_new: int, sampling: Sampling) -> Generation:
    """The target alone, one token per pass over its cache (the speed-up's reference)."""
    start = time.perf_counter()
    token, _ = sampling.pick(target.start(prompt).logits[-1])
    tokens = [token]
    while len(tokens) < max_new:
        token, _ = sampling.pick(target.extend(prompt.new_tensor([token])).logits[-1])
        tokens.append(token)
    return Generation(tokens, [], time.perf_counter() - start)


def acceptance(rounds: list[tuple[int, int]], k: int) -> dict[str, object]:
    """tau (mean kept + 1 per round) and per-position acceptance: of the rounds that proposed a token at
    position i, the share that kept it."""
    if not rounds:
        return {"tau": None, "rounds": 0, "per_position": []}
    per_position = []
    for i in range(k):
        offered = [kept for proposed, kept in rounds if proposed > i]
        per_position.append(sum(kept > i for kept in offered) / len(offered) if offered else None)
    return {"tau": sum(kept + 1 for _, kept in rounds) / len(rounds), "rounds": len(rounds),
            "per_position": per_position}
