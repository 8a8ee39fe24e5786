"""Drafters for ``decoding.speculative_generate``: prompt lookup (n-gram), a small causal LM (the KD student), and
the EAGLE-3 head; and the target, a Hugging Face causal LM behind a key/value cache, as decoding drives it.

The two drafters that run a model keep their own key/value cache (transformers' ``DynamicCache``) across rounds and
across calls. A cached position stays valid while the ids it was computed from are unchanged (the model is causal),
so each ``propose`` crops its cache to the longest prefix it shares with the new context (the accepted tokens)
and runs only the rest: the rejected draft tokens are dropped, a new prompt starts over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from kdcache.stages.draft.decoding import Proposal, Sampling, TargetPass

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.stages.draft.model import Eagle3Draft


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` (transformers' ``crop`` takes the count to remove as a
    negative number)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _shared(seen: list[int], ids: list[int]) -> int:
    """How many leading ids ``seen`` and ``ids`` share."""
    return next((i for i, (a, b) in enumerate(zip(seen, ids)) if a != b), min(len(seen), len(ids)))


@dataclass
class HFTarget:
    """A causal LM as a ``decoding.Target``: one ``DynamicCache`` per sequence. With ``layers``, each pass also
    gives those hidden states (HF numbering) of the positions it ran, concatenated, ``[S, len(layers) * d]``."""

    model: PreTrainedModel
    layers: tuple[int, ...] | None = None
    cache: DynamicCache | None = field(default=None, repr=False)

    def start(self, prompt: torch.Tensor) -> TargetPass:
        self.cache = DynamicCache(config=self.model.config)
        return self.extend(prompt)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor) -> TargetPass:
        out = self.model(tokens[None].to(self.model.device), past_key_values=self.cache, use_cache=True,
                         output_hidden_states=self.layers is not None)
        features = None if self.layers is None else torch.cat([out.hidden_states[j][0] for j in self.layers], -1)
        return TargetPass(out.logits[0], features)

    def crop(self, length: int) -> None:
        if self.cache is not None:
            crop_cache(self.cache, length)


@dataclass
class PromptLookup:
    """Proposes the tokens that followed the earliest earlier occurrence of the context's last n tokens (n from
    ``longest`` down to 1; the earliest leaves the longest continuation, as transformers' prompt lookup takes it);
    nothing when no n-gram recurs. Its proposals are certain (q one-hot). It runs no model, so has no cache."""

    longest: int = 3
    name: str = "prompt lookup"

    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal:
        seq = ids.tolist()
        for n in range(min(self.longest, len(seq) - 1), 0, -1):
            tail = seq[-n:]
            start = next((i for i in range(len(seq) - n) if seq[i:i + n] == tail), None)
            if start is not None:
                return Proposal(torch.tensor(seq[start + n:start + n + k], dtype=torch.int64), None)
        return Proposal(torch.zeros(0, dtype=torch.int64), None)


@dataclass
class ModelDrafter:
    """A small causal LM with the target's tokenizer (the KD student) drafting k tokens one by one over its own
    cache (module docstring): ``fed`` are the ids its cache holds."""

    model: PreTrainedModel
    name: str = "KD student"
    cache: DynamicCache | None = field(default=None, repr=False)
    fed: list[int] = field(default_factory=list, repr=False)

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal:
        logits = self._catch_up(ids.tolist())
        tokens: list[int] = []
        dists: list[torch.Tensor | None] = []
        for step in range(k):
            token, probs = sampling.pick(logits)
            tokens.append(token)
            dists.append(probs)
            if step + 1 < k:  # the last drafted token is never run: the target checks it
                logits = self._feed([token])
        return _proposal(tokens, dists, sampling)

    def _catch_up(self, seq: list[int]) -> torch.Tensor:
        """The cache cropped to what it shares with ``seq`` (at least the last id is rerun, for its logits), the
        rest fed; the next-token logits ``[V]``."""
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
        keep = min(_shared(self.fed, seq), len(seq) - 1)
        crop_cache(self.cache, keep)
        self.fed = self.fed[:keep]
        return self._feed(seq[keep:])

    def _feed(self, tokens: list[int]) -> torch.Tensor:
        out = self.model(torch.tensor([tokens], device=self.model.device), past_key_values=self.cache,
                         use_cache=True)
        self.fed += tokens
        return out.logits[0, -1]


@dataclass
class Eagle3Drafter:
    """The EAGLE-3 head: step 0 over the context's new positions, then k-1 steps on its own output (see
    ``model``'s docstring), over its own cache of its one layer. ``features [T-1, 3d]`` are the target's fused
    layers of every context position but the last; position t's step-0 key reads them and the id at t + 1, so it
    stays valid while ``ids[:t + 2]`` does. ``seen``: the context ids of the last call."""

    draft: Eagle3Draft
    name: str = "EAGLE-3 head"
    cache: DynamicCache = field(default_factory=DynamicCache, repr=False)
    seen: list[int] = field(default_factory=list, repr=False)

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal:
        if features is None:
            raise ValueError("an EAGLE-3 drafter needs the target's features of its fused layers")
        seq, device = ids.tolist(), self.draft.fc.weight.device
        keep = max(0, min(_shared(self.seen, seq) - 1, len(seq) - 2))  # the last position is always rerun
        crop_cache(self.cache, keep)
        self.seen = seq
        tokens_in, hidden = ids[keep + 1:].to(device)[None], self.draft.fuse(features[keep:].to(device)[None])
        positions = torch.arange(keep, len(seq) - 1, device=device)
        target_ids, tokens, dists = self.draft.target_ids, [], []
        for _ in range(k):
            hidden, logits = self.draft.step(tokens_in, hidden, positions, self.cache)
            hidden = hidden[:, -1:]
            index, probs = sampling.pick(logits[0, -1])
            token = int(target_ids[index])
            tokens.append(token)
            dists.append(None if probs is None else _on_target_vocab(probs, target_ids, self.draft.t2d.shape[0]))
            tokens_in, positions = tokens_in.new_tensor([[token]]), positions[-1:] + 1
        return _proposal(tokens, dists, sampling)


def _on_target_vocab(probs: torch.Tensor, target_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """A draft-vocabulary distribution ``[N]`` as one over the target's ``[V]`` (zero off the draft tokens)."""
    full = torch.zeros(vocab, dtype=probs.dtype)
    full[target_ids.cpu()] = probs.cpu()
    return full


def _proposal(tokens: list[int], dists: list[torch.Tensor | None], sampling: Sampling) -> Proposal:
    q = None if sampling.greedy or not tokens else torch.stack([d for d in dists if d is not None])
    return Proposal(torch.tensor(tokens, dtype=torch.int64), q)
