"""``kdcache generate``'s counter-based draws (issue 58): Philox-4x32-10 in int64 tensor ops.

What is checked: the tensor hash gives the integers of a plain-Python Philox written here from the paper's
definition (Python's unbounded ints: no 16-bit split, no masking tricks) and Random123's published known answers;
a uniform is the stated function of (seed, prompt, response number, step); the uniforms are uniform (chi-square
and Kolmogorov-Smirnov at the 0.999 quantile) and neighbouring ones unrelated; a row's draws do not depend on its
batch or on the step a run starts from; tokens drawn by inverse CDF follow the temperature/top-k/top-p
distribution. No model: tensors only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from kdcache.stages.precompute.generation.options import Sampling
from kdcache.stages.precompute.generation.sampling import ResponseDraws, next_tokens, philox, uniforms

M32 = 2**32 - 1


def reference_philox(counter: tuple[int, ...], key: tuple[int, int]) -> list[int]:
    """Philox-4x32-10 as Salmon et al. define it, in plain Python ints."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
        k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
    return c


def reference_uniform(seed: int, prompt: int, response: int, step: int) -> float:
    """A token's uniform: counter (step, 0, response, prompt), key the seed's halves, 53 bits of words 0 and 1."""
    words = reference_philox((step, 0, response, prompt), (seed % 2**32, (seed // 2**32) % 2**32))
    return ((words[0] >> 5) * 2**26 + (words[1] >> 6)) / 2**53


def test_the_tensor_hash_gives_the_integers_of_a_plain_python_philox() -> None:
    known = {  # Random123's kat_vectors for philox4x32_10: counter, key -> output
        ((0, 0, 0, 0), (0, 0)): [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
        ((M32,) * 4, (M32, M32)): [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)):
            [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]}
    for (counter, key), want in known.items():
        assert reference_philox(counter, key) == want
        assert philox(torch.tensor([counter]), key)[0].tolist() == want
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, size=(500, 4), dtype=np.uint64).astype(np.int64)
    counters[:20] = M32  # the largest words: where a wrong carry or a signed overflow would show
    for key in ((0, 0), (M32, M32), (0x12345678, 0x9ABCDEF0)):
        got = philox(torch.from_numpy(counters), key).tolist()
        assert got == [reference_philox(tuple(c), key) for c in counters.tolist()]


def test_a_uniform_is_the_stated_function_of_seed_prompt_response_and_step() -> None:
    keys = [(0, 0), (3, 1), (2**31, 7), (123_456, 0)]
    for seed in (0, 3, 2**40 + 17, -1):  # a seed beyond 32 bits fills the key's second word; -1: two's complement
        got = uniforms(seed, torch.tensor(keys), range(62, 67))
        want = [[reference_uniform(seed, p, r, t) for t in range(62, 67)] for p, r in keys]
        assert got.dtype == torch.float64 and got.tolist() == want


def test_a_rows_draws_depend_on_neither_its_batch_nor_the_step_a_run_starts_at() -> None:
    keys = [(5, 0), (5, 1), (9, 0), (0, 3)]
    together = ResponseDraws(keys, 11, torch.device("cpu"))
    table = torch.stack([together.at(t) for t in range(150)], dim=1)  # three blocks of 64 steps
    for i, key in enumerate(keys):
        alone = ResponseDraws([key], 11, torch.device("cpu"))
        resumed = ResponseDraws([(0, 0), key], 11, torch.device("cpu"))  # another row, and started at step 100
        assert torch.equal(torch.stack([alone.at(t) for t in range(150)], dim=1)[0], table[i])
        assert torch.equal(torch.stack([resumed.at(t) for t in range(100, 150)], dim=1)[1], table[i, 100:])
    assert len(set(table.flatten().tolist())) == table.numel()  # no two draws alike


def test_the_draws_are_uniform_and_neighbours_unrelated() -> None:
    """4,096 draws (64 responses x 64 steps): each bound is the statistic's 0.999 quantile under uniformity."""
    keys = torch.tensor([(p, r) for p in range(16) for r in range(4)])
    draws = uniforms(2026, keys, range(64)).numpy()
    assert draws.min() >= 0 and draws.max() < 1
    counts = np.bincount((draws.ravel() * 64).astype(int), minlength=64)
    assert ((counts - 64) ** 2 / 64).sum() < stats.chi2.ppf(0.999, 63)  # 103.4
    assert stats.kstest(draws.ravel(), "uniform").statistic < stats.kstwo.ppf(0.999, draws.size)  # 0.0304
    for a, b in ((draws[:, :-1], draws[:, 1:]), (draws[:-1], draws[1:])):  # next step; next response
        pairs = np.bincount((a.ravel() * 8).astype(int) * 8 + (b.ravel() * 8).astype(int), minlength=64)
        expected = a.size / 64
        assert ((pairs - expected) ** 2 / expected).sum() < stats.chi2.ppf(0.999, 63)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8)])
def test_tokens_follow_the_processed_distribution(temperature: float, top_k: int, top_p: float) -> None:
    """4,096 rows of the same 12 logits, one draw each: the counts against softmax(z / T) cut to the top k, then
    to the fewest whose mass reaches p, renormalised (chi-square at its 0.999 quantile; tokens cut never drawn)."""
    logits = torch.linspace(2.0, -1.5, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(0))]
    sampling = Sampling(1, temperature, top_p, top_k, 8, (), 1)
    u = uniforms(1, torch.tensor([(p, 0) for p in range(4096)]), range(1))[:, 0]
    drawn = next_tokens(logits.expand(4096, -1), sampling, u)
    probs = np.sort(torch.softmax(logits.double() / temperature, -1).numpy())[::-1]
    order = np.argsort(-logits.numpy(), kind="stable")
    keep = np.arange(12) < (top_k or 12)
    keep &= np.cumsum(probs * keep) / (probs * keep).sum() - probs * keep / (probs * keep).sum() < top_p
    expected = np.zeros(12)
    expected[order[keep]] = probs[keep] / probs[keep].sum() * 4096
    counts = np.bincount(drawn.numpy(), minlength=12)
    assert counts[expected == 0].sum() == 0 and keep.sum() >= 2
    kept = expected > 0
    assert ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum() < stats.chi2.ppf(0.999, kept.sum() - 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the prepared GPU check runs it)")
def test_a_gpu_gives_the_cpus_integers_uniforms_and_tokens() -> None:
    """The same words, uniforms and tokens from tensors on the GPU as on the CPU (exact integer arithmetic; the
    tokens of fp32 logits far from any tie)."""
    counters = torch.from_numpy(np.random.default_rng(1).integers(0, 2**32, size=(4096, 4), dtype=np.uint64)
                                .astype(np.int64))
    key = (0xDEADBEEF, 0x01234567)
    assert torch.equal(philox(counters.cuda(), key).cpu(), philox(counters, key))
    keys = torch.tensor([(p, r) for p in range(64) for r in range(4)])
    on_cpu = uniforms(7, keys, range(100, 164))
    assert torch.equal(uniforms(7, keys.cuda(), range(100, 164)).cpu(), on_cpu)
    logits = torch.randn(256, 1000, generator=torch.Generator().manual_seed(2)) * 3
    sampling = Sampling(7, 0.8, 0.9, 50, 8, (), 1)
    cpu_tokens = next_tokens(logits, sampling, on_cpu[:, 0])
    assert torch.equal(next_tokens(logits.cuda(), sampling, on_cpu[:, 0].cuda()).cpu(), cpu_tokens)
