"""Issue 63: one step of each vocabulary term holds a bounded number of one chunk's logits, whatever N.

The peak is read deterministically (``tests.helpers.live_bytes``: the heap in use after every torch operator),
not as RSS, so a loaded machine cannot move it. The pass over ``HeadLogits`` builds a chunk's ``[C, V]`` float32
logits and its gradient one chunk at a time; the CE and a KL together legitimately hold a few such buffers at once
(the logits, CE's saved log-softmax, two buffers of its backward pass), and ``BOUND`` allows that with a margin.
Before the fix, each chunk's ``dz`` outlived its iteration of ``HeadPass`` (one buffer more for every kind) and the
other-bucket KL's autograd chain held another: CE + top-k ``other`` measured 7.2 chunks, CE + renorm 6.2, against
5.2 after (N = 1,024; 5.15 at the N here).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kdcache.stages.targets.logits.full_torch import kd_kl_term
from kdcache.stages.targets.logits.head_torch import head_kl_term
from kdcache.stages.targets.logits.sampled_torch import sampled_kl_term
from kdcache.stages.targets.logits.topk_torch import topk_kl_term
from kdcache.stages.targets.logits.vocab import loss_rows, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.feed.ahead import batch_bytes
from kdcache.stages.train.feed.device_feed import Batch, DeviceFeed
from kdcache.stages.train.feed.streaming import CacheStream, to_device
from kdcache.stages.train.losses.logits import causal_ce_term
from tests.helpers.full_cache import write_full_cache
from tests.helpers.live_bytes import MALLINFO2, LiveBytes

pytestmark = pytest.mark.skipif(MALLINFO2 is None, reason="needs glibc's mallinfo2 (glibc 2.33 or later)")

N, D, V, K, DRAWS, D_T = 512, 32, 8192, 16, 12, 16  # two chunks of 256 rows: a chunk's buffers meet the next one's
CHUNK_LOGITS = loss_rows.LOSS_CHUNK * V * 4  # one chunk's [C, V] float32 logits: 8 MiB
# Chunks' logits held at once, at most, by one step of CE + one KL (CE alone 4.2, with a KL 5.2 after the fix; the
# fixed part, the head's [V, d] gradient and the step's [N, ...] rows, is 0.2 of a chunk here). A KL against a dense
# teacher (full, head) also holds the teacher's [C, V] chunk: one more (6.4 after the fix).
BOUND, DENSE = 5.6, ("full", "head")


@pytest.fixture(scope="module")
def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(1, N, V, generator=g) * 2
    values, ids = teacher.topk(K, -1)
    masks = token_masks(torch.ones(1, N, dtype=torch.long), None, None, causal=True)
    return {"hidden": torch.randn(1, N, D, generator=g), "weight": torch.randn(V, D, generator=g) / D**0.5,
            "ids": torch.randint(0, V, (1, N), generator=g).float(), "real": masks.real, "pairs": masks.pairs,
            "mask": masks.predicts,
            "teacher": teacher, "values": values, "topk_ids": ids.float(), "lse": teacher.logsumexp(-1),
            "draws": torch.randint(0, V, (1, N, DRAWS), generator=g), "counts": torch.ones(1, N, DRAWS),
            "logp": -torch.rand(1, N, DRAWS, generator=g) * 5, "hidden_t": torch.randn(1, N, D_T, generator=g),
            "w_t": torch.randn(V, D_T, generator=g)}


KLS: dict[str, Callable[[HeadLogits, dict[str, torch.Tensor]], vocab_pass.ChunkTerm]] = {
    "topk_renorm": lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["mask"], variant="renorm"),
    "topk_other": lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["mask"], s["lse"], variant="other"),
    "full": lambda z, s: kd_kl_term(z, s["teacher"], s["mask"], 1.0),
    "sampled": lambda z, s: sampled_kl_term(z, s["draws"], s["counts"], s["logp"], s["mask"], 1.0),
    "head": lambda z, s: head_kl_term(z, s["hidden_t"], lambda x: x @ s["w_t"].T, s["mask"], 1.0),
}


def _step_peak(s: dict[str, torch.Tensor], kl: str | None) -> float:
    """The peak of one forward + backward of CE (+ the KL) over ``HeadLogits``, in chunks' logits."""
    hidden, weight = s["hidden"].clone().requires_grad_(True), s["weight"].clone().requires_grad_(True)
    with LiveBytes() as live:
        z = HeadLogits(hidden, weight)
        terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"])] + ([] if kl is None else [KLS[kl](z, s)])
        total, _ = vocab_pass.vocab_pass(z, terms, [1.0] * len(terms))
        total.backward()
        del z, terms, total
    return live.peak / CHUNK_LOGITS


@pytest.fixture(scope="module")
def warm(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inputs after one step, once per module: the first step also builds torch's lazily made state (11.5
    chunks for CE + the head KL), and every step after it reads the same peak to 0.003 of a chunk."""
    _step_peak(inputs, "head")
    return inputs


@pytest.mark.parametrize("kl", [None, *KLS])
def test_one_step_of_each_vocabulary_term_holds_a_few_chunks_of_logits(warm: dict[str, torch.Tensor],
                                                                       kl: str | None) -> None:
    """CE + each KL kind stays under ``BOUND`` chunks' logits, one more for a dense teacher and one less for CE
    alone (one step, after the module's warm-up step)."""
    peak, bound = _step_peak(warm, kl), BOUND - (kl is None) + (kl in DENSE)
    assert peak <= bound, f"CE + {kl}: {peak:.2f} chunks of [C, V] float32 logits at once (bound {bound})"


def test_bucket_log_probs_gradient_matches_autograd_in_float64() -> None:
    """``BucketLogProbs``' written-out gradient against autograd's chain of logsumexps, in float64."""
    g = torch.Generator().manual_seed(1)
    z = (torch.randn(6, 40, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ids = torch.rand(6, 40, generator=g).argsort(-1)[:, :5]
    weights = torch.randn(6, 6, generator=g, dtype=torch.float64)
    (loss_rows.BucketLogProbs.apply(z, ids) * weights).sum().backward()
    ours, z.grad = z.grad, None
    lse = z.logsumexp(-1, keepdim=True)
    tail = z.scatter(1, ids, float("-inf")).logsumexp(-1, keepdim=True) - lse
    (torch.cat([z.gather(1, ids) - lse, tail], -1) * weights).sum().backward()
    torch.testing.assert_close(ours, z.grad, rtol=1e-12, atol=1e-12)


ROWS, LENGTH = 2, 256  # one batch of a full cache: 512 tokens, its fp16 logits 8 MiB (1 chunk); float32: 16 MiB
# Besides BOUND + 1 (a dense teacher's chunk) and the batch as stored: its ids, the chunk's fp16 teacher rows
# before they widen, the stream's own objects (6.9 in all here; a float32 copy of the batch: 9.4).
FEED_MARGIN = 0.5


@pytest.fixture(scope="module")
def full_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_full_cache(tmp_path_factory.mktemp("full") / "cache", [LENGTH] * ROWS, V, ROWS)


def _feed_step_peak(cache: Path) -> tuple[float, int]:
    """The peak of reading one batch of the cache through the stream and ``to_device`` (``DeviceFeed``, as the loop
    does) and one step of CE + the full KL over ``HeadLogits`` on it, in chunks' logits; and the batch's bytes."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(ROWS, LENGTH, D, generator=g).requires_grad_(True)
    weight = (torch.randn(V, D, generator=g) / D**0.5).requires_grad_(True)
    stored: list[int] = []  # the host batch's bytes, as the cache stores its values

    def prepare(host: Batch) -> Batch:
        stored.append(batch_bytes(host))
        return to_device(host, "cpu")
    with LiveBytes() as live:
        stream = CacheStream(cache, ["input_ids", "logits/full"], batch_size=ROWS, epochs=1, decode_threads=1)
        for batch in DeviceFeed(stream, prepare, torch.device("cpu")):
            masks = token_masks(batch["mask"], None, None, causal=True)
            z = HeadLogits(hidden, weight)
            terms = [causal_ce_term(z, batch["input_ids"], masks.real, masks.pairs),
                     kd_kl_term(z, batch["logits/full"], masks.predicts, 1.0)]
            total, _ = vocab_pass.vocab_pass(z, terms, [1.0, 1.0])
            total.backward()
            del z, terms, total, batch, masks
    return live.peak / CHUNK_LOGITS, stored[0]


def test_the_full_kl_through_the_feed_holds_the_stored_batch_and_a_few_chunks(full_cache: Path) -> None:
    """One step of CE + the full KL on a batch read through the real stream and ``to_device`` holds the batch as
    stored (fp16) and the pass's chunks, not a whole-batch float32 copy of ``[B, L, V]`` (2 chunks more here):
    the least of two steps under ``BOUND`` + 1 (dense) + the stored batch + ``FEED_MARGIN`` chunks' logits."""
    results = [_feed_step_peak(full_cache) for _ in range(2)]
    peak, stored = min(p for p, _ in results), results[0][1]
    bound = BOUND + 1 + stored / CHUNK_LOGITS + FEED_MARGIN
    assert peak <= bound, f"{peak:.2f} chunks of [C, V] float32 logits at once (bound {bound:.2f})"
