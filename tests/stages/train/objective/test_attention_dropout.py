"""Attention losses read the student's attention *before* dropout (issue 32), in train mode with dropout 0.1.

Each family's student (GPT-2, Llama with rotary and grouped-query heads, BERT) is loaded the way training loads
it, put in train mode with attention dropout 0.1 (and no other dropout, so that block 1's input is the same in
every forward), and run three ways: maps (``MAPS_ATTENTION``, the KL against a maps cache), queries and keys (the
recorder, the blocked KL against a q/k cache) and MiniLMv2 relations (a qkv cache). Every value and gradient is
compared with a reference written here: a forward pre-hook takes the attention module's input, and the test
recomputes that block's queries, keys and values with the module's own weights, its softmax *without* dropout,
and the KL of the docs' formula.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.targets.attention.attention_maps import MAPS_ATTENTION
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.attention.qk_attention import QKRecorder
from kdcache.stages.targets.attention.qk_loss import cached_qk_loss
from kdcache.stages.train.core.masks import stream_masks
from kdcache.stages.train.core.student import load_student
from kdcache.stages.train.feed.streaming import collate, to_device
from kdcache.stages.train.objective.distill import student_inputs
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, sample_texts, write_text_dataset

P = 0.1
TOL = 1e-3
FLOOR = 1e-12  # the documented floor on a student probability before its log (docs/losses.md)
STUDENTS = {"gpt2": (make_tiny_gpt2, {"heads": 2, "attn_pdrop": P, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
            "llama": (make_tiny_llama, {"heads": 2, "kv_heads": 1, "attention_dropout": P}),
            "bert": (make_tiny_bert, {"heads": 2, "attention_probs_dropout_prob": P, "hidden_dropout_prob": 0.0})}
PAIRS = ((1, 1), (2, 2))  # block 1 reads the embeddings (no dropout before it); block 2 reads block 1's output


def _cache(tmp_path: Path, teacher: Path, source: str) -> dict[str, Any]:
    """A cache of the teacher's blocks 1 and 2 (``source``: maps, qk or qkv), as one collated batch."""
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(8, seed=3))
    out = tmp_path / f"cache-{source}"
    run_precompute(PrecomputeOptions.of(
        teacher=str(teacher), data=str(data), out=str(out), max_length=32, batch_size=4, sequences_per_shard=8,
        progress=False, packing="none", features=("attention", "logits"), top_k=4, layers=("1", "2"),
        attention_source=source))
    reader = CacheReader(out)
    ids = list(range(min(4, len(reader))))
    batch = to_device(collate([reader[i] for i in ids], ids), "cpu")
    return {"batch": batch, "scores": reader.spec.attention_scores}


def _student(family: str, tmp_path: Path, attn: str | None) -> Any:
    make, shape = STUDENTS[family]
    path = tmp_path / "student"
    if not (path / "config.json").exists():
        make(path, seed=7, layers=2, initializer_range=0.3, vocab_size=200 if family == "bert" else 320, **shape)
    student = load_student(path, attn_implementation=attn).float().train()
    return student


def _attention_module(student: Any, family: str, block: int) -> torch.nn.Module:
    if family == "gpt2":
        return student.transformer.h[block - 1].attn
    if family == "llama":
        return student.model.layers[block - 1].self_attn
    return student.bert.encoder.layer[block - 1].attention.self


class _Inputs:
    """Forward pre-hooks keeping each block's attention input (``hidden_states [B, L, D]`` and its kwargs)."""

    def __init__(self, student: Any, family: str) -> None:
        self.seen: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
        self.handles = [_attention_module(student, family, b).register_forward_pre_hook(self._hook(b), with_kwargs=True)
                        for b in (1, 2)]

    def _hook(self, block: int) -> Any:
        def keep(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.seen[block] = (hidden, kwargs)
        return keep


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, length, width = x.shape
    return x.reshape(b, length, heads, width // heads).transpose(1, 2)  # [B, heads, L, d]


def _qkv(student: Any, family: str, block: int, inputs: _Inputs) -> tuple[torch.Tensor, ...]:
    """The block's ``q [B, H, L, d]``, ``k``, ``v [B, H_kv, L, d]`` recomputed from its input with its weights."""
    hidden, kwargs = inputs.seen[block]
    module, cfg = _attention_module(student, family, block), student.config
    if family == "gpt2":
        q, k, v = module.c_attn(hidden).split(cfg.n_embd, dim=2)
        return _heads(q, cfg.n_head), _heads(k, cfg.n_head), _heads(v, cfg.n_head)
    if family == "bert":
        heads = cfg.num_attention_heads
        return _heads(module.query(hidden), heads), _heads(module.key(hidden), heads), _heads(module.value(hidden), heads)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = _heads(module.q_proj(hidden), cfg.num_attention_heads)
    k, v = (_heads(proj(hidden), cfg.num_key_value_heads) for proj in (module.k_proj, module.v_proj))
    cos, sin = kwargs["position_embeddings"]
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _softmax(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q·kᵀ / sqrt(d)) over real (and, causal, earlier) keys, no dropout: ``[B, H, L, L]``."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    length = q.shape[2]
    allowed = mask.bool()[:, None, None, :].expand(-1, 1, length, -1)
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, -1e9), dim=-1)  # finite: a padded row stays finite


def _kl(p_t: torch.Tensor, p_s: torch.Tensor, real: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Mean over heads and counted rows of Σ_keys p_t log(p_t / p_s), teacher heads averaged in groups."""
    b, h_t, length, _ = p_t.shape
    p_t = p_t.reshape(b, p_s.shape[1], h_t // p_s.shape[1], length, length).mean(2)
    keys = real.bool()[:, None, None, :]
    p_t = torch.where(keys, p_t, 0.0)
    p_t = p_t / p_t.sum(-1, keepdim=True).clamp_min(1e-30)  # padded query rows: all zero, not NaN
    terms = torch.where(p_t > 0, p_t * (p_t.clamp_min(1e-30).log() - p_s.clamp_min(FLOOR).log()), 0.0)
    counted = rows.bool()[:, None, :]
    return terms.sum(-1).masked_select(counted).sum() / (p_s.shape[1] * counted.sum())


def _relation(x_s: torch.Tensor, x_t: torch.Tensor, real: torch.Tensor, rows: torch.Tensor, heads: int,
              causal: bool) -> torch.Tensor:
    """MiniLMv2: token rows ``[B, L, W]`` split into ``heads`` relation heads, softmax(x·xᵀ / sqrt(W / heads))."""
    return _kl(_softmax(_heads(x_t, heads), _heads(x_t, heads), real, causal),
               _softmax(_heads(x_s, heads), _heads(x_s, heads), real, causal), real, rows)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)


def _grad(value: torch.Tensor, student: Any) -> torch.Tensor:
    params = [p for p in student.parameters() if p.requires_grad]
    grads = torch.autograd.grad(value, params, retain_graph=True, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(params, grads)])


def _same(got: torch.Tensor, want: torch.Tensor, student: Any) -> None:
    assert want.item() > 1e-2  # a random student is far from the teacher: the comparison means something
    assert got.item() == pytest.approx(want.item(), rel=TOL)
    g_got, g_want = _grad(got, student), _grad(want, student)
    assert float((g_got - g_want).norm() / g_want.norm()) < TOL


def _forward(student: Any, family: str, batch: dict[str, Any], causal: bool, recorder: QKRecorder | None = None,
             ) -> tuple[Any, _Inputs, dict[int, Any]]:
    inputs = _Inputs(student, family)
    torch.manual_seed(11)
    if recorder is None:
        out = student(**student_inputs(student, batch, causal), output_attentions=True)
        captured: dict[int, Any] = {}
    else:
        with recorder.forward():
            out = student(**student_inputs(student, batch, causal))
        captured = dict(recorder.captured)
    for handle in inputs.handles:
        handle.remove()
    return out, inputs, captured


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_attention_losses_read_probabilities_before_dropout(family: str, tmp_path: Path,
                                                            request: pytest.FixtureRequest) -> None:
    teacher, causal = request.getfixturevalue(f"tiny_{family}"), family != "bert"
    maps, qk = _cache(tmp_path, teacher, "maps"), _cache(tmp_path, teacher, "qkv")
    batch = maps["batch"]
    masks = stream_masks(batch, causal=causal)

    student = _student(family, tmp_path, MAPS_ATTENTION)
    out, inputs, _ = _forward(student, family, batch, causal)
    by_maps = {}
    for s, t in PAIRS:
        sums = out.attentions[s - 1].sum(-1)  # [B, H, L]
        sums = sums[masks.real.bool()[:, None, :].expand_as(sums)]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5)  # distributions, not dropout's rescaled rows
        reference = _kl(batch[f"attention/{t}"], _softmax(*_qkv(student, family, s, inputs)[:2], masks.real, causal),
                        masks.real, masks.trained)
        by_maps[s] = attention_kl(out.attentions[s - 1], batch[f"attention/{t}"], masks.real, queries=masks.trained)
        _same(by_maps[s], reference, student)

    sdpa = _student(family, tmp_path, None)
    recorder = QKRecorder(sdpa, [s for s, _ in PAIRS], causal)
    _, inputs, captured = _forward(sdpa, family, qk["batch"], causal, recorder)
    for s, t in PAIRS:
        q, k, v = _qkv(sdpa, family, s, inputs)
        reference = _kl(batch[f"attention/{t}"], _softmax(q, k, masks.real, causal), masks.real, masks.trained)
        by_qk = cached_qk_loss("kl", captured[s], qk["batch"], t, qk["scores"], masks.real, masks.trained)
        _same(by_qk, reference, sdpa)
        if s == 1:  # the same input in both forwards: the two sources agree with each other too
            assert by_qk.item() == pytest.approx(by_maps[1].item(), rel=TOL)
        heads = 2
        relation = sum(_relation(_rows(x), qk["batch"][f"attention_{kind}/{t}"], masks.real, masks.trained, heads,
                                 causal) for kind, x in zip("qkv", (q, k, v)))
        by_relation = cached_qk_loss("relation", captured[s], qk["batch"], t, qk["scores"], masks.real,
                                     masks.trained, relation_heads=heads)
        _same(by_relation, relation, sdpa)
