"""Speculative decoding keeps the target's output: exactly its greedy tokens for any draft, and its distribution
when sampling (a chi-square test on a tiny vocabulary)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from scipy import stats

from kdcache.stages.draft.decoding import (
    Proposal,
    Sampling,
    TargetPass,
    acceptance,
    speculative_generate,
    target_generate,
)
from kdcache.stages.draft.drafters import Eagle3Drafter, HFTarget, ModelDrafter, PromptLookup
from kdcache.stages.draft.model import DraftShape, Eagle3Draft, default_heads
from kdcache.stages.draft.vocab import DraftVocab
from tests.helpers.tiny_models import make_tiny_llama, sample_texts

LAYERS = (2, 4, 5)
K = 4


@dataclass
class Recompute:
    """A ``Target`` from a function of the whole sequence (ids ``[S]`` -> its ``TargetPass`` over all S
    positions), rerun on every pass: a target with no cache of its own (a table)."""

    fn: Callable[[torch.Tensor], TargetPass]
    ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def start(self, prompt: torch.Tensor) -> TargetPass:
        self.ids = prompt
        return self.fn(prompt)

    def extend(self, tokens: torch.Tensor) -> TargetPass:
        self.ids, n = torch.cat([self.ids, tokens.to(self.ids)]), tokens.shape[0]
        out = self.fn(self.ids)
        return TargetPass(out.logits[-n:], None if out.features is None else out.features[-n:])

    def crop(self, length: int) -> None:
        self.ids = self.ids[:length]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    """A random 8-block Llama in float64 (greedy ties cannot flip between a short and a long pass), its
    tokenizer, and a random 2-block student of the same vocabulary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("spec")
    path = make_tiny_llama(root / "target", layers=8, hidden=16, heads=2, kv_heads=1, intermediate=32)
    student = make_tiny_llama(root / "student", layers=2, hidden=16, heads=2, kv_heads=1, intermediate=32, seed=1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p).double().eval()  # noqa: E731
    return load(path), AutoTokenizer.from_pretrained(path), load(student)


def _untrained_head(model) -> Eagle3Draft:
    d, vocab = model.config.hidden_size, model.config.vocab_size
    torch.manual_seed(3)
    counts = torch.randint(0, 50, (vocab,))
    words = DraftVocab.most_frequent(counts, 64)
    shape = DraftShape(d, vocab, 64, default_heads(d), 2 * d, LAYERS)
    return Eagle3Draft(shape, model.get_input_embeddings().weight.detach(), words.d2t, words.t2d).double().eval()


def _prompts(tokenizer) -> list[torch.Tensor]:
    return [torch.tensor(tokenizer(text)["input_ids"][:10]) for text in sample_texts(2, seed=5)]


@pytest.mark.parametrize("kind", ["eagle3", "lookup", "student"])
def test_greedy_speculative_decoding_returns_the_targets_greedy_tokens(target, kind: str):
    model, tokenizer, student = target
    drafter = {"eagle3": lambda: Eagle3Drafter(_untrained_head(model)), "lookup": lambda: PromptLookup(),
               "student": lambda: ModelDrafter(student)}[kind]()
    run = HFTarget(model, LAYERS)
    for prompt in _prompts(tokenizer):
        alone = target_generate(run, prompt, 12, Sampling())
        spec = speculative_generate(run, drafter, prompt, 12, K, Sampling())
        assert spec.tokens == alone.tokens
        assert sum(kept + 1 for _, kept in spec.rounds) + 1 == 12  # the prefill emits the first token


class _Recorded:
    """Delegates to a drafter (``fresh``: a new one for every call, so no cache is ever reused) and records what
    it proposes."""

    name = "recorded"

    def __init__(self, make, fresh: bool):
        self.make, self.fresh, self.drafter, self.proposed = make, fresh, make(), []

    def propose(self, ids, features, k, sampling) -> Proposal:
        proposal = (self.make() if self.fresh else self.drafter).propose(ids, features, k, sampling)
        self.proposed.append(proposal.tokens.tolist())
        return proposal


@pytest.mark.parametrize("kind", ["eagle3", "student"])
def test_a_drafter_reusing_its_cache_proposes_what_a_fresh_one_does(target, kind: str):
    # The cache is cropped to the accepted tokens each round and reused across prompts: every proposal must be the
    # one a drafter with no cache makes from the whole context (greedy, float64: no tie can flip).
    model, tokenizer, student = target
    make = {"eagle3": lambda: Eagle3Drafter(_untrained_head(model)), "student": lambda: ModelDrafter(student)}[kind]
    reused, fresh = _Recorded(make, fresh=False), _Recorded(make, fresh=True)
    for prompt in _prompts(tokenizer):
        for drafter in (reused, fresh):
            speculative_generate(HFTarget(model, LAYERS), drafter, prompt, 8, K, Sampling())
    assert reused.proposed == fresh.proposed and len(reused.proposed) >= 4  # rounds over both prompts


class _Oracle:
    """Proposes the target's own greedy continuation: every token must be kept."""

    name = "oracle"

    def __init__(self, tokens: list[int], start: int):
        self.tokens, self.start = tokens, start

    def propose(self, ids, features, k, sampling) -> Proposal:
        done = ids.shape[0] - self.start
        return Proposal(torch.tensor(self.tokens[done:done + k], dtype=torch.int64), None)


def test_a_draft_that_proposes_the_targets_tokens_is_always_kept(target):
    model, tokenizer, _ = target
    run, prompt = HFTarget(model), _prompts(tokenizer)[0]
    alone = target_generate(run, prompt, 21, Sampling())
    spec = speculative_generate(run, _Oracle(alone.tokens, prompt.shape[0]), prompt, 21, K, Sampling())
    assert spec.tokens == alone.tokens
    report = acceptance(spec.rounds, K)
    assert report["tau"] == K + 1 and report["per_position"] == [1.0] * K


# ---- sampling: a bigram target on a tiny vocabulary ------------------------------------------------------------
V = 4


class _Bigram:
    """Proposes from a bigram table Q; with ``claims`` it reports another table as its q (a broken draft)."""

    name = "bigram"

    def __init__(self, table: torch.Tensor, claims: torch.Tensor | None = None):
        self.table, self.claims = table, table if claims is None else claims

    def propose(self, ids, features, k, sampling) -> Proposal:
        last, tokens, q = int(ids[-1]), [], []
        for _ in range(k):
            last = sampling.draw(self.table[last])
            tokens.append(last)
            q.append(self.claims[tokens[-2] if len(tokens) > 1 else int(ids[-1])])
        return Proposal(torch.tensor(tokens, dtype=torch.int64), torch.stack(q) if q else None)


def _transitions(drafter, p: torch.Tensor, seed: int) -> np.ndarray:
    """Counts ``[V, V]`` of (token, next token) over 150 generations of 24 tokens, speculative with K = 3."""
    log_p = p.log()
    run = Recompute(lambda ids: TargetPass(log_p[ids], None))  # logits: the next token's row of P
    sampling = Sampling(1.0, torch.Generator().manual_seed(seed))
    counts = np.zeros((V, V), dtype=np.int64)
    for g in range(150):
        out = speculative_generate(run, drafter, torch.tensor([g % V]), 24, 3, sampling)
        seq = [g % V, *out.tokens]
        np.add.at(counts, (seq[:-1], seq[1:]), 1)
    return counts


def _chi_square_p_value(counts: np.ndarray, p: torch.Tensor) -> float:
    expected = counts.sum(1, keepdims=True) * p.numpy()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    return float(stats.chi2.sf(statistic, V * (V - 1)))


@pytest.fixture(scope="module")
def tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    p = torch.distributions.Dirichlet(torch.ones(V, V, dtype=torch.float64)).sample()
    q = torch.softmax(torch.randn(V, V, generator=g, dtype=torch.float64) * 2, -1)  # far from P
    return p, q


def test_sampled_speculative_decoding_follows_the_targets_distribution(tables):
    # A correct sampler fails this at significance 1e-3: with the fixed seeds, a false failure has probability
    # 1e-3 over the choice of seed, and then fails every time.
    p, q = tables
    counts = _transitions(_Bigram(q), p, seed=0)
    assert counts.sum() == 150 * 24
    assert _chi_square_p_value(counts, p) > 1e-3


def test_the_chi_square_test_catches_a_draft_that_misreports_q(tables):
    # Claiming q = p makes every draft token kept, so the output follows Q: the test must see it.
    p, q = tables
    counts = _transitions(_Bigram(q, claims=p), p, seed=0)
    assert _chi_square_p_value(counts, p) < 1e-12
