"""Drafters for ``decoding.speculative_generate``: prompt lookup (n-gram), a small causal LM (the KD student), and
the EAGLE-3 head; and the target, a Hugging Face causal LM, as the callable decoding checks them with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdcache.stages.draft.decoding import Proposal, Sampling, TargetFn, TargetPass

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.stages.draft.model import Eagle3Draft


def hf_target(model: PreTrainedModel, layers: tuple[int, ...] | None = None) -> TargetFn:
    """The target as decoding calls it: ids ``[S]`` -> logits ``[S, V]`` and, with ``layers``, those hidden states
    (HF numbering) concatenated, ``[S, len(layers) * d]``."""
    @torch.no_grad()
    def run(ids: torch.Tensor) -> TargetPass:
        out = model(ids[None].to(model.device), output_hidden_states=layers is not None)
        features = None if layers is None else torch.cat([out.hidden_states[j][0] for j in layers], dim=-1)
        return TargetPass(out.logits[0], features)
    return run


@dataclass
class PromptLookup:
    """Proposes the tokens that followed the earliest earlier occurrence of the context's last n tokens (n from
    ``longest`` down to 1; the earliest leaves the longest continuation, as transformers' prompt lookup takes it);
    nothing when no n-gram recurs. Its proposals are certain (q one-hot)."""

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
    """A small causal LM with the target's tokenizer (the KD student) drafting k tokens one by one."""

    model: PreTrainedModel
    name: str = "KD student"

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal:
        seq, tokens, dists = ids.to(self.model.device), [], []
        for _ in range(k):
            token, probs = sampling.pick(self.model(seq[None]).logits[0, -1])
            tokens.append(token)
            dists.append(probs)
            seq = torch.cat([seq, seq.new_tensor([token])])
        return _proposal(tokens, dists, sampling)


@dataclass
class Eagle3Drafter:
    """The EAGLE-3 head: step 0 over the context's target features, then k-1 steps on its own output (see
    ``model``'s docstring). ``features [T-1, 3d]`` are the fused layers of every context position but the last."""

    draft: Eagle3Draft
    name: str = "EAGLE-3 head"

    @torch.no_grad()
    def propose(self, ids: torch.Tensor, features: torch.Tensor | None, k: int, sampling: Sampling) -> Proposal:
        if features is None:
            raise ValueError("an EAGLE-3 drafter needs the target's features of its fused layers")
        device = self.draft.fc.weight.device
        tokens_in, past = ids[1:].to(device)[None], list[tuple[torch.Tensor, torch.Tensor]]()
        hidden = self.draft.fuse(features.to(device)[None])
        positions = torch.arange(tokens_in.shape[1], device=device)
        target_ids, tokens, dists = self.draft.target_ids, [], []
        for _ in range(k):
            hidden, logits = self.draft.step(tokens_in, hidden, positions, past)
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
