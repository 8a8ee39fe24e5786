"""Attention from cached queries and keys (issue 23): the blocked KL equals the KL of the maps, in value and gradient.

Real tiny GPT-2, Llama (rotary, grouped-query) and BERT teachers are cached twice from the same rows, once as maps
and once as queries and keys (fp16 both); a real student of each family (fewer heads) runs once with eager
attention (its maps) and once under the q/k recorder with SDPA. The attention KL of the two paths must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.runner import run_precompute
from kdcache.stages.targets.attention.maps_loss import attention_kl
from kdcache.stages.targets.attention.qk_attention import Captured, QKRecorder, ScoreRule, allowed_keys, block_log_probs
from kdcache.stages.targets.attention.qk_loss import blocked_attention_kl, heads_from_rows, relation_kl
from kdcache.stages.train.core.masks import stream_masks
from kdcache.stages.train.evaluation.evaluate import evaluate_run
from kdcache.stages.train.feed.streaming import collate, to_device
from kdcache.stages.train.objective.distill import student_inputs
from kdcache.storage import CacheReader, verify_cache
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama, sample_texts, write_text_dataset

STUDENTS = {"gpt2": (make_tiny_gpt2, {"heads": 2, "layers": 2, "initializer_range": 0.3}),
            "llama": (make_tiny_llama, {"heads": 2, "kv_heads": 1, "layers": 2, "initializer_range": 0.3}),
            "bert": (make_tiny_bert, {"heads": 2, "layers": 2, "initializer_range": 0.3})}
REL = 1e-3


def _cache(tmp_path: Path, teacher: Path, source: str, packing: str, codec: str | None = None,
           layers: tuple[str, ...] = ("1", "2")) -> CacheReader:
    data = write_text_dataset(tmp_path / "data.jsonl", sample_texts(10, seed=5))
    out = tmp_path / f"cache-{source}-{codec or 'float'}"
    run_precompute(PrecomputeOptions.of(
        teacher=str(teacher), data=str(data), out=str(out), max_length=40, batch_size=4, sequences_per_shard=8,
        progress=False, packing=packing, features=("hidden", "attention", "logits"), layers=layers, top_k=4,
        attention_source=source, hidden_codec=codec))
    return CacheReader(out)


def _batch(reader: CacheReader) -> dict[str, Any]:
    ids = list(range(min(6, len(reader))))
    return to_device(collate([reader[i] for i in ids], ids), "cpu")


def _student(family: str, teacher_dir: Path, path: Path, attn: str) -> Any:
    import transformers

    make, shape = STUDENTS[family]
    if not (path / "config.json").exists():
        make(path, seed=7, vocab_size=320 if family != "bert" else 200, **shape)
    cls = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    return cls.from_pretrained(str(path), attn_implementation=attn, dtype=torch.float32)


def _maps_kl(student: Any, batch: dict[str, Any], causal: bool) -> torch.Tensor:
    masks = stream_masks(batch, causal=causal)
    out = student(**student_inputs(student, batch, causal), output_attentions=True)
    return attention_kl(out.attentions[1], batch["attention/2"], masks.real, queries=masks.trained)


def _qk_kl(student: Any, batch: dict[str, Any], scores: dict[str, Any], causal: bool, block: int) -> torch.Tensor:
    masks = stream_masks(batch, causal=causal)
    recorder = QKRecorder(student, (2,), causal)
    with recorder.forward():
        student(**student_inputs(student, batch, causal))
    mine = recorder.captured[2]
    rule = ScoreRule.from_json(scores["blocks"]["2"], scores["causal"])
    teacher = Captured(heads_from_rows(batch["attention_q/2"], scores["num_heads"]),
                        heads_from_rows(batch["attention_k/2"], scores["num_kv_heads"]), rule)
    return blocked_attention_kl(Captured(mine.q, mine.k, mine.rule), teacher, masks.real, masks.trained,
                                batch.get("position_ids"), block=block)


def _grads(student: Any) -> torch.Tensor:
    grads = [p.grad.flatten() for p in student.parameters() if p.grad is not None]
    return torch.cat(grads)


@pytest.mark.parametrize("family,packing", [("gpt2", "none"), ("llama", "none"), ("bert", "none"),
                                            ("llama", "documents"), ("gpt2", "documents")])
def test_qk_kl_equals_maps_kl_in_value_and_gradient(family: str, packing: str, tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    teacher = request.getfixturevalue(f"tiny_{family}")
    maps, qk = _cache(tmp_path, teacher, "maps", packing), _cache(tmp_path, teacher, "qk", packing)
    assert qk.spec.attention_source == "qk" and "attention/2" not in qk.spec.sequence_names()
    b_maps, b_qk = _batch(maps), _batch(qk)
    assert torch.equal(b_maps["input_ids"], b_qk["input_ids"])
    causal = family != "bert"
    eager = _student(family, teacher, tmp_path / "student", "eager")
    value_maps = _maps_kl(eager, b_maps, causal)
    value_maps.backward()
    sdpa = _student(family, teacher, tmp_path / "student", "sdpa")
    value_qk = _qk_kl(sdpa, b_qk, qk.spec.attention_scores, causal, block=5)  # several blocks, a ragged last one
    value_qk.backward()
    assert value_maps.item() > 1e-2  # a random student is far from the teacher: the comparison means something
    assert value_qk.item() == pytest.approx(value_maps.item(), rel=REL)
    g_maps, g_qk = _grads(eager), _grads(sdpa)
    assert float((g_qk - g_maps).norm() / g_maps.norm()) < REL


@pytest.mark.parametrize("codec,code_dtype", [("int8", np.int8), ("fp8", np.uint8)])
def test_coded_queries_and_keys_give_the_kl_of_fp16_ones(codec: str, code_dtype: type, tmp_path: Path,
                                                         tiny_llama: Path) -> None:
    """``--hidden-codec`` applies to the cached q/k (activations): codes and companions are stored, verified,
    decoded on the device by ``to_device``, and the blocked KL stays within 2% of the fp16 cache's."""
    every = ("1", "2", "3")  # the last block too: the training step's uniform layer map reads it
    plain = _cache(tmp_path, tiny_llama, "qk", "none", layers=every)
    coded = _cache(tmp_path, tiny_llama, "qk", "none", codec, layers=every)
    item = coded.get(0)
    for kind in ("attention_q", "attention_k"):
        assert item[f"{kind}/2"].dtype == code_dtype and item[f"{kind}_scale/2"].dtype == np.float16
        assert item[f"{kind}_outlier_ids/2"].dtype == np.uint16 and f"{kind}_outliers/2" in item
        record = coded.records[0].lossy[f"{kind}/2"]
        assert record["codec"] == codec and 0 < record["rel_rms_error"] < 0.06 and record["worst_row_cosine"] > 0.99
    assert plain.get(0)["attention_q/2"].dtype == np.float16 and "attention_q_scale/2" not in plain.get(0)
    assert verify_cache(tmp_path / f"cache-qk-{codec}").ok
    ids = list(range(6))
    b_plain = _batch(plain)
    b_coded = to_device(collate([coded[i] for i in ids], ids), "cpu", coded.spec.hidden_codec)
    assert not [n for n in b_coded if "_scale/" in n or "_outlier" in n]  # companions dropped once decoded
    assert b_coded["attention_q/2"].dtype == torch.float32
    assert b_coded["attention_q/2"].shape == b_plain["attention_q/2"].shape
    student = _student("llama", tiny_llama, tmp_path / "student", "sdpa")
    with torch.no_grad():
        want = _qk_kl(student, b_plain, plain.spec.attention_scores, True, block=5)
        got = _qk_kl(student, b_coded, coded.spec.attention_scores, True, block=5)
    assert want.item() > 1e-2 and got.item() == pytest.approx(want.item(), rel=2e-2)
    run = tmp_path / "run"
    assert main(["train", "--cache", str(tmp_path / f"cache-qk-{codec}"), "--student", str(tmp_path / "student"),
                 "--out", str(run), "--zero-stage", "0", "--max-steps", "1", "--batch-size", "4", "--delta", "1",
                 "--json"]) == 0  # one step: the loop decodes the coded q/k on its device before the blocked KL
    result = evaluate_run(run, coded, batch_size=4)
    assert all(np.isfinite(v) for v in result["attention"]["pairs"].values())


def test_blocks_equal_one_pass_and_the_full_maps_exactly() -> None:
    torch.manual_seed(0)
    b, length, d = 2, 11, 4
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, 8:] = 0
    positions = torch.cat([torch.arange(5), torch.arange(6)])[None].repeat(b, 1)
    rule_t, rule_s = ScoreRule(0.4, True, sliding_window=4, softcap=5.0), ScoreRule(0.5, True)
    t_side = Captured(torch.randn(b, 4, length, d), torch.randn(b, 2, length, d), rule_t)
    s_q, s_k = torch.randn(b, 2, length, d, requires_grad=True), torch.randn(b, 1, length, d, requires_grad=True)
    values, grads = [], []
    for block in (3, length):
        value = blocked_attention_kl(Captured(s_q, s_k, rule_s), t_side, mask, position_ids=positions, block=block)
        values.append(value)
        grads.append(torch.cat([g.flatten() for g in torch.autograd.grad(value, (s_q, s_k))]))
    assert torch.allclose(values[0], values[1], rtol=1e-6) and torch.allclose(grads[0], grads[1], atol=1e-7)
    rows = slice(0, length)
    docs = (positions == 0).long().cumsum(-1)
    a_t = block_log_probs(t_side.q, t_side.k, rule_t, allowed_keys(mask, rows, rule_t, docs)).exp()
    a_s = block_log_probs(s_q, s_k, rule_s, allowed_keys(mask, rows, rule_s, docs)).exp()
    assert torch.allclose(attention_kl(a_s, a_t, mask), values[0], rtol=1e-5)


def test_relation_loss_matches_a_direct_computation() -> None:
    torch.manual_seed(1)
    b, length, relation_heads = 2, 7, 4
    x_s = torch.randn(b, length, 12, requires_grad=True)  # student width 12, teacher 32: only R is shared
    x_t = torch.randn(b, length, 32)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[0, 5:] = 0
    value = relation_kl(x_s, x_t, mask, relation_heads, causal=True)
    direct = x_s.new_zeros(())
    for i in range(b):
        n = int(mask[i].sum())
        for x, r_out in ((x_s, "s"), (x_t, "t")):
            heads = x[i, :n].reshape(n, relation_heads, -1).transpose(0, 1)  # [R, n, W/R]
            scores = heads @ heads.transpose(1, 2) / (heads.shape[-1] ** 0.5)
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            if r_out == "s":
                log_s = torch.log_softmax(scores, -1)
            else:
                p_t = torch.softmax(scores, -1)
        direct = direct + torch.where(p_t > 0, p_t * (torch.log(p_t) - log_s), torch.zeros_like(p_t)).sum()
    direct = direct / (relation_heads * int(mask.sum()))
    assert value.item() == pytest.approx(direct.item(), rel=1e-5)
    g_value, = torch.autograd.grad(value, x_s)
    g_direct, = torch.autograd.grad(direct, x_s)
    assert torch.allclose(g_value, g_direct, atol=1e-6)


def test_t5_queries_and_keys_are_refused_naming_the_relative_bias(tmp_path: Path) -> None:
    from tests.helpers.tiny_models import make_tiny_t5, write_pair_dataset

    teacher = make_tiny_t5(tmp_path / "t5")
    data = write_pair_dataset(tmp_path / "pairs.jsonl", [("a b c", "d e"), ("f g", "h i j")])
    with pytest.raises(PrecomputeError, match="relative position bias"):
        run_precompute(PrecomputeOptions.of(
            teacher=str(teacher), data=str(data), out=str(tmp_path / "c"), source_column="source",
            target_column="target", features=("hidden", "attention"), attention_source="qk", progress=False))


def test_a_model_adding_to_its_scores_is_refused(tiny_gpt2: Path, tmp_path: Path) -> None:
    """A bias the queries and keys do not carry (here ALiBi-like, added by a wrapped attention) is caught by the
    first batch's check of the rebuilt scores."""
    import transformers

    from kdcache.stages.targets.attention.qk_attention import QKRecorderError, check_rule

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gpt2), dtype=torch.float32)
    recorder = QKRecorder(model, (1,), True, keep_output=True)
    ids = torch.randint(5, 100, (1, 9))
    with torch.no_grad(), recorder.forward():
        model(input_ids=ids, use_cache=False)
    captured = recorder.captured[1]
    mask = torch.ones_like(ids)
    check_rule(captured, mask, None, "gpt2 block 1")  # the model as it is: reproduced
    captured.rule = ScoreRule(captured.rule.scaling * 1.5, True)  # a different score than the model used
    with pytest.raises(QKRecorderError, match="something else is added"):
        check_rule(captured, mask, None, "gpt2 block 1")


def test_the_check_in_blocks_of_query_rows_agrees_with_the_model(tiny_gpt2: Path) -> None:
    """The check rebuilds the first sequence a few query rows at a time (never the batch's [B, H, L, L] maps):
    blocks that do not divide the length, with padding, still reproduce the model and still catch a wrong rule."""
    import transformers

    from kdcache.stages.targets.attention.qk_attention import QKRecorderError, check_rule

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gpt2), dtype=torch.float32)
    recorder = QKRecorder(model, (1, 2), True, keep_output=True)
    ids = torch.randint(5, 100, (2, 11), generator=torch.Generator().manual_seed(0))  # not the suite's RNG state
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    with torch.no_grad(), recorder.forward():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    for block in (1, 4, 128):
        check_rule(recorder.captured[2], mask, None, "gpt2 block 2", block=block)
    # A random tiny model's scores are small, so a 1.5x scaling can move the output less than the tolerance; 8x
    # moves it by far more for any ids.
    recorder.captured[2].rule = ScoreRule(recorder.captured[2].rule.scaling * 8, True)
    with pytest.raises(QKRecorderError, match="gpt2 block 2: its attention output differs"):
        check_rule(recorder.captured[2], mask, None, "gpt2 block 2", block=4)


def _tiny_gpt_oss(path: Path | None = None) -> Any:
    """A random GPT-OSS (attention sinks: a softmax column that queries and keys do not give), saved with a
    tokenizer when ``path`` is given."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from tests.helpers.tiny_models import _save, train_bpe_tokenizer

    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    if path is None:
        return GptOssForCausalLM(config).eval()
    tokenizer = train_bpe_tokenizer(path, vocab_size=320, add_bos=True)
    config.vocab_size, config.eos_token_id = len(tokenizer), tokenizer.eos_token_id
    config.bos_token_id, config.pad_token_id = tokenizer.bos_token_id, tokenizer.pad_token_id
    return _save(GptOssForCausalLM(config), tokenizer, path)


def test_attention_sinks_are_refused_by_stage_one_naming_the_maps(tmp_path: Path) -> None:
    teacher = _tiny_gpt_oss(tmp_path / "gpt-oss")
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(4))
    with pytest.raises(PrecomputeError, match="attention sinks.*--attention-source maps"):
        run_precompute(PrecomputeOptions.of(teacher=str(teacher), data=str(data), out=str(tmp_path / "c"),
                                            features=("hidden", "attention"), attention_source="qk", progress=False))


def test_attention_sinks_are_refused_by_stage_two_as_a_loss_error() -> None:
    from kdcache.stages.common.loss_errors import LossError
    from kdcache.stages.train.objective.distill import recorded

    student = _tiny_gpt_oss()
    recorder = QKRecorder(student, (1,), True)
    with torch.no_grad(), pytest.raises(LossError, match="attention sinks.*--attention-source maps"):
        recorded(recorder, lambda: student(input_ids=torch.randint(0, 100, (1, 5)), use_cache=False))


def test_sliding_windows_and_soft_capping_are_recorded_and_reproduced() -> None:
    """Mistral's window and Gemma 2's alternating window and logit soft-cap: each block's rule is recorded from
    what the model hands its kernel, and the rebuilt scores reproduce its attention output (padding included)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, MistralForCausalLM

    from kdcache.stages.targets.attention.qk_attention import check_rule

    torch.manual_seed(0)
    shape = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64, sliding_window=4)
    mistral = MistralForCausalLM(MistralConfig(**shape)).eval()
    gemma = Gemma2ForCausalLM(Gemma2Config(**shape, head_dim=8, attn_logit_softcapping=0.5,
                                           query_pre_attn_scalar=16)).eval()
    ids = torch.randint(0, 100, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    rules = {}
    for name, model in (("mistral", mistral), ("gemma", gemma)):
        recorder = QKRecorder(model, (1, 2), True, keep_output=True)
        with torch.no_grad(), recorder.forward():
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        for j, captured in recorder.captured.items():
            check_rule(captured, mask, None, f"{name} block {j}")
            rules[name, j] = captured.rule
    assert rules["mistral", 1].sliding_window == 4 and rules["mistral", 1].softcap is None
    assert (rules["gemma", 1].sliding_window, rules["gemma", 2].sliding_window) == (4, None)  # alternating layers
    assert rules["gemma", 2].softcap == 0.5 and rules["gemma", 2].scaling == pytest.approx(16 ** -0.5)


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
def test_qkv_arrays_round_trip_as_token_rows(backend: str, tmp_path: Path) -> None:
    import numpy as np

    from kdcache.storage import CacheSpec, CacheWriter
    from kdcache.storage.core.errors import SpecError

    scores = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "causal": True,
              "blocks": {"2": {"scaling": 0.35, "sliding_window": None, "softcap": None}}}
    spec = CacheSpec(num_sequences=2, backend=backend, attention_layers=(2,), attention_source="qkv",
                     attention_scores=scores)
    assert CacheSpec.from_dict(spec.to_dict()) == spec
    assert "attention_source" not in CacheSpec(num_sequences=1, attention_layers=(2,)).to_dict()  # maps: as before
    rng = np.random.default_rng(0)
    items = [{"input_ids": np.arange(n), "attention_q/2": rng.standard_normal((n, 32)).astype(np.float32),
              "attention_k/2": rng.standard_normal((n, 16)).astype(np.float32),
              "attention_v/2": rng.standard_normal((n, 16)).astype(np.float32)} for n in (5, 3)]
    writer = CacheWriter(tmp_path / "c", spec, {})
    writer.write_shard(0, items)
    writer.finalize()
    back = CacheReader(tmp_path / "c").get(1, names=["attention_k"])
    assert list(back) == ["attention_k/2"]
    np.testing.assert_allclose(back["attention_k/2"].astype(np.float32), items[1]["attention_k/2"], atol=1e-3)
    for bad in ({"attention_triangle": True}, {"attention_heads": (0,)}, {"attention_scores": {"num_heads": 4}}):
        with pytest.raises(SpecError):
            CacheSpec(**{**dict(num_sequences=2, attention_layers=(2,), attention_source="qk",
                                attention_scores=scores), **bad})
