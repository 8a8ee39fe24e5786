"""The fused vocabulary kernel at a GPU's shapes: V = 128,256 (Llama 3's vocabulary), d = 2,048, 1,024-token rows
with padding, through ``vocab_pass`` on ``--vocab-kernel fused`` (so a failed guard check raises rather than
quietly taking the pure-torch road) against the same pass on the pure-torch road, in bfloat16 and float32.

CUDA only: skipped on a machine without one, or where Triton's interpreter is on (the CPU cases of
tests/stages/targets/logits/vocab/test_fused_kernel.py run the same kernel there at small shapes). benchmarks/gpu_check.sh runs it."""

from __future__ import annotations

import os

import pytest
import torch

from kdcache.stages.targets.logits.full_torch import kd_kl_term
from kdcache.stages.targets.logits.sampled_torch import sampled_kl_term
from kdcache.stages.targets.logits.topk_torch import topk_kl_term
from kdcache.stages.targets.logits.vocab import kernel_guard, vocab_pass
from kdcache.stages.targets.logits.vocab.head_logits import HeadLogits
from kdcache.stages.train.core.masks import token_masks
from kdcache.stages.train.losses.logits import causal_ce_term

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
                                reason="a CUDA device, compiled (not Triton's interpreter)")

B, L, D, V, K, DRAWS, T = 2, 1024, 2048, 128_256, 128, 64, 2.0
DEVICE, PAD_FROM, DRAWN_FROM = "cuda", 900, 4096
# max |fused − torch| ≤ rtol · max |torch|: the guard's own bound for dz (kernel_guard.TOLERANCE), doubled for the
# [N, d] and [V, d] gradients, which sum dz over a chunk's rows or columns in the logits' dtype.
RTOL = {torch.float32: 2e-4, torch.bfloat16: 3.2e-2}


def _setup(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A student head, a teacher's logits (top-k, dense and drawn ids from them) and masks; the second row is 900
    real tokens, its padding NaN in every target."""
    dev = torch.device(DEVICE)
    g = torch.Generator(device=dev).manual_seed(0)
    teacher = torch.randn(B, L, V, generator=g, device=dev, dtype=torch.bfloat16) * 2
    values, ids = teacher.float().topk(K, -1)
    probs = torch.softmax(teacher[:, :, :DRAWN_FROM].float(), -1)  # ids drawn from the first few (cheap to draw)
    draws = torch.multinomial(probs.flatten(0, 1), DRAWS, replacement=True, generator=g).view(B, L, DRAWS)
    mask = torch.ones(B, L, dtype=torch.long, device=dev)
    mask[1, PAD_FROM:] = 0
    masks = token_masks(mask, causal=True)
    s = {"hidden": torch.randn(B, L, D, generator=g, device=dev) * 0.5,
         "weight": torch.randn(V, D, generator=g, device=dev) * D ** -0.5,
         "ids": torch.randint(0, V, (B, L), generator=g, device=dev).float(), "teacher": teacher,
         "values": values, "topk_ids": ids.float(), "draws": draws, "counts": torch.ones_like(draws),
         "logp": probs.gather(-1, draws).log()}
    for k in ("ids", "values", "topk_ids", "logp"):
        s[k][1, PAD_FROM:] = float("nan")
    s["hidden"], s["weight"] = s["hidden"].to(dtype), s["weight"].to(dtype)
    return {**s, "real": masks.real, "pairs": masks.pairs, "predicts": masks.predicts}


KINDS = {
    "renorm": lambda z, s: topk_kl_term(z, s["values"], s["topk_ids"], s["predicts"], variant="renorm",
                                        temperature=T),
    "full": lambda z, s: kd_kl_term(z, s["teacher"], s["predicts"], T),
    "sampled": lambda z, s: sampled_kl_term(z, s["draws"], s["counts"], s["logp"], s["predicts"], T),
}


def _pass(s: dict[str, torch.Tensor], kind: str, road: str) -> tuple[torch.Tensor, ...]:
    """α·CE + β·KL on ``road``: the value, the per-term values and the gradients of hidden and weight."""
    kernel_guard.set_road(road)
    h, w = s["hidden"].clone().requires_grad_(True), s["weight"].clone().requires_grad_(True)
    z = HeadLogits(h, w, None)
    terms = [causal_ce_term(z, s["ids"], s["real"], s["pairs"]), KINDS[kind](z, s)]
    total, values = vocab_pass.vocab_pass(z, terms, [0.5, 1.0])
    total.backward()
    return total.detach(), values, h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kernel_at_llama_shapes_equals_the_pure_torch_pass(kind: str, dtype: torch.dtype) -> None:
    s = _setup(dtype)
    fused = _pass(s, kind, "fused")
    assert kernel_guard.GUARD.trusted and kernel_guard.GUARD.given_up is None  # the kernel ran and passed its check
    reference = _pass(s, kind, "torch")
    for name, got, want in zip(("total", "values", "hidden", "weight"), fused, reference):
        assert torch.isfinite(got).all(), name
        gap = float((got.double() - want.double()).abs().max())
        bound = (RTOL[dtype] if name in ("hidden", "weight") else 1e-4) * float(want.double().abs().max())
        assert gap <= bound, f"{kind} {dtype} {name}: off by {gap:.3g}, bound {bound:.3g}"
