"""A loss on a batch streamed from the cache equals the same loss with the teacher run online, for every kind.

The teacher is loaded here, in the test, only to produce the online reference; stage two itself never loads it.
The cache stores fp16, so the tolerance is fp16's: relative ~1e-3 on values of order one.
"""

from __future__ import annotations

import pytest
import torch

from kdcache.stages.common.option_groups import assemble
from kdcache.stages.targets.hidden.wgan import Critic, critic_loss
from kdcache.stages.train.core.options import LossOptions
from kdcache.stages.train.feed.streaming import CacheStream, to_device
from kdcache.stages.train.losses import get_loss
from kdcache.stages.train.objective.compound import CompoundLoss
from tests.helpers.tiny_models import make_tiny_gpt2, sample_texts
from tests.stages.train._train_support import write_cache

TOL = dict(rel=5e-3, abs=2e-4)
LAYERS = (0, 1, 2, 3)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """One batch read from a full-logit and a top-k cache, the online teacher outputs on it, and a student."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("online")
    teacher_dir = make_tiny_gpt2(root / "teacher", layers=3, hidden=32, heads=4)
    student_dir = make_tiny_gpt2(root / "student", layers=2, hidden=16, heads=2, seed=1)
    caches = {kind: write_cache(teacher_dir, root / kind, num_sequences=12, sequences_per_shard=4, logits=kind)
              for kind in ("full", "topk")}
    names = {"full": ["input_ids", "logits/full"], "topk": ["input_ids", "logits/topk_values", "logits/topk_ids",
                                                             "logits/lse"]}
    names["full"] += [f"hidden/{j}" for j in LAYERS] + [f"attention/{j}" for j in LAYERS[1:]]
    batches = {k: to_device(next(iter(CacheStream(caches[k], names[k], batch_size=6, seed=2))), "cpu")
               for k in caches}
    assert torch.equal(batches["full"]["sample_ids"], batches["topk"]["sample_ids"])
    batch = batches["full"]
    teacher = AutoModelForCausalLM.from_pretrained(str(teacher_dir), attn_implementation="eager").eval()
    student = AutoModelForCausalLM.from_pretrained(str(student_dir), attn_implementation="eager").eval()
    # The online run tokenizes the same texts again: the cache's input_ids must be exactly the tokenizer's.
    online_ids = _retokenize(teacher_dir, batch["sample_ids"].tolist(), batch["input_ids"].shape[1])
    assert torch.equal(online_ids, batch["input_ids"])
    with torch.no_grad():
        kw = dict(attention_mask=batch["mask"], output_hidden_states=True, output_attentions=True)
        online, student_out = teacher(input_ids=online_ids, **kw), student(input_ids=batch["input_ids"], **kw)
    return {"cached": batch, "topk": batches["topk"], "online": online, "online_ids": online_ids, "student": student_out,
            "mask": batch["mask"], "proj": torch.nn.Linear(16, 32)}


def _retokenize(teacher_dir: object, sample_ids: list[int], width: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(teacher_dir))
    texts = sample_texts(12, seed=0)
    rows = [tok(texts[i], truncation=True, max_length=24)["input_ids"] for i in sample_ids]
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def _online_topk(case: dict, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = case["online"].logits.float()
    values, ids = logits.topk(k, dim=-1)
    return values, ids, torch.logsumexp(logits, dim=-1)


def test_logit_losses(case: dict) -> None:
    s, mask, cached, topk = case["student"].logits, case["mask"], case["cached"], case["topk"]
    t_online = case["online"].logits
    online_ids = case["online_ids"]
    assert float(get_loss("ce")(s, cached["input_ids"], mask)) == float(get_loss("ce")(s, online_ids, mask))
    kl = get_loss("kl")
    assert float(kl(s, cached["logits/full"], mask, 2.0)) == pytest.approx(float(kl(s, t_online, mask, 2.0)), **TOL)
    values, ids, lse = _online_topk(case, topk["logits/topk_values"].shape[-1])
    for variant, temperature in (("renorm", 2.0), ("other", 1.0)):
        loss = get_loss("topk_kl")
        from_cache = loss(s, topk["logits/topk_values"], topk["logits/topk_ids"], mask, topk["logits/lse"],
                          variant=variant, temperature=temperature)
        online = loss(s, values, ids, mask, lse, variant=variant, temperature=temperature)
        assert float(from_cache) == pytest.approx(float(online), **TOL), variant


@pytest.mark.parametrize("name", ["mse", "cosine", "cka", "cka_sqrt"])
def test_hidden_losses_on_every_cached_layer(name: str, case: dict) -> None:
    loss, mask = get_loss(name), case["mask"]
    h_s = case["student"].hidden_states[-1]
    with torch.no_grad():
        h_s = case["proj"](h_s) if name in ("mse", "cosine") else h_s
    for j in LAYERS:
        from_cache = float(loss(h_s, case["cached"][f"hidden/{j}"], mask))
        online = float(loss(h_s, case["online"].hidden_states[j], mask))
        assert from_cache == pytest.approx(online, **TOL), (name, j)


def test_attention_kl_with_head_groups(case: dict) -> None:
    loss, mask = get_loss("attention_kl"), case["mask"]
    a_s = case["student"].attentions[1]  # 2 student heads against 4 cached teacher heads: groups of 2
    for j in LAYERS[1:]:
        from_cache = float(loss(a_s, case["cached"][f"attention/{j}"], mask))
        online = float(loss(a_s, case["online"].attentions[j - 1], mask))
        assert from_cache == pytest.approx(online, **TOL), j


def test_wgan_critic_loss(case: dict) -> None:
    torch.manual_seed(0)
    critic, mask = Critic(32), case["mask"]
    with torch.no_grad():
        h_s = case["proj"](case["student"].hidden_states[2])
    values = []
    for h_t in (case["cached"]["hidden/3"], case["online"].hidden_states[3]):
        torch.manual_seed(1)  # the same interpolation points for the gradient penalty
        values.append(float(critic_loss(critic, h_s, h_t, mask, 10.0).detach()))
    assert values[0] == pytest.approx(values[1], **TOL)


def test_the_compound_loss_as_training_computes_it(case: dict) -> None:
    pairs = [(1, 1), (2, 3)]
    options = assemble(LossOptions, {"alpha": 1.0, "beta": 1.0, "gamma": 1.0, "delta": 1.0, "temperature": 2.0})
    loss = CompoundLoss(options, layer_map=pairs, student_dim=16, teacher_dim=32)
    online = {"input_ids": case["cached"]["input_ids"], "logits/full": case["online"].logits,
              **{f"hidden/{j}": case["online"].hidden_states[j] for j in LAYERS},
              **{f"attention/{j}": case["online"].attentions[j - 1] for j in LAYERS[1:]}}
    with torch.no_grad():
        a = loss(case["student"], case["cached"], case["mask"])
        b = loss(case["student"], online, case["mask"])
    for term in ("loss", "ce", "kl", "hidden", "attention"):
        assert float(a[term].detach()) == pytest.approx(float(b[term].detach()), **TOL), term


def test_online_batch_is_the_cached_batch(case: dict) -> None:
    """Sanity: the reference really ran on the cached input_ids (right-padded, so valid tokens agree)."""
    mask = case["mask"].bool()
    cached, online = case["cached"]["hidden/3"][mask], case["online"].hidden_states[3][mask]
    assert torch.allclose(cached, online, rtol=2e-3, atol=2e-3)
