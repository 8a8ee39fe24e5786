"""Stage two and init-student for seq2seq students (issue 6): BART and T5 trained from their caches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.core.checks import CacheCheckError
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.feed.streaming import collate
from kdcache.stages.train.init_student import block_list_prefix
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from kdcache.stages.train.losses.cross_attention import cross_attention_kl
from tests.helpers.tiny_models import make_tiny_bart, make_tiny_gpt2, make_tiny_t5, sample_pairs, write_pair_dataset
from tests.stages.train._train_support import make_student_config, write_cache

SHALLOW = {"bart": {"encoder_layers": 1, "decoder_layers": 1}, "t5": {"num_layers": 1, "num_decoder_layers": 1}}


@pytest.fixture(scope="module")
def setups(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per model kind: a 2+2-block teacher and its cache (hidden, attention, cross-attention, top-8 logits)."""
    root = tmp_path_factory.mktemp("seq2seq-train")
    data = write_pair_dataset(root / "pairs.jsonl", sample_pairs(24))
    out = {}
    for name, build in (("bart", make_tiny_bart), ("t5", make_tiny_t5)):
        teacher = build(root / name)
        cache = root / f"cache-{name}"
        assert main(["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(cache),
                     "--source-column", "source", "--target-column", "target", "--features",
                     "hidden,attention,cross_attention,logits", "--top-k", "8", "--sequences-per-shard", "6", "--max-length", "32",
                     "--no-progress"]) == 0
        out[name] = {"teacher": teacher, "cache": cache}
    return out


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_student_trains_under_zero2_and_exports(name, setups, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    student = make_student_config(tmp_path / "student", setups[name]["teacher"], **SHALLOW[name])
    options = TrainOptions.of(cache=str(setups[name]["cache"]), student=str(student), out=str(tmp_path / "run"),
                           zero_stage=2, max_steps=12, batch_size=4, lr=3e-3, gamma=1.0, delta=1.0,
                           temperature=1.0, log_every=1, decoder_layer_map="explicit:1-2",
                           encoder_layer_map="last")
    summary = run_training(options)
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert summary["zero_stage"] == 2 and len(records) == 12
    for term in ("ce", "topk_kl", "encoder/hidden", "decoder/hidden/s1_t2", "encoder/attention",
                 "decoder/attention", "cross_attention/s1_t2"):
        assert term in records[0], term
    for term in ("loss", "ce", "decoder/hidden", "encoder/hidden"):  # top-k KL of two random models starts near 0
        first, last = records[0][term], np.mean([r[term] for r in records[-3:]])
        assert last < first, f"{term} did not fall: {first} -> {last}"
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["hidden_pairs"] == [[1, 2]]
    model = AutoModelForSeq2SeqLM.from_pretrained(summary["student_dir"]).eval()
    tok = AutoTokenizer.from_pretrained(summary["student_dir"])
    ids = tok(["The quick brown fox"], return_tensors="pt")
    generated = model.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[0] == 1 and generated.shape[1] >= 2


def test_init_student_copies_chosen_blocks_of_each_stack(setups, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    teacher_dir = setups["t5"]["teacher"]
    assert main(["init-student", "--teacher", str(teacher_dir), "--encoder-layers", "2", "--decoder-layers", "1,2",
                 "--out", str(tmp_path / "s")]) == 0
    teacher = AutoModelForSeq2SeqLM.from_pretrained(str(teacher_dir))
    student = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "s"))
    assert (student.config.num_layers, student.config.num_decoder_layers) == (1, 2)
    t, s = teacher.state_dict(), student.state_dict()
    enc, dec = block_list_prefix(teacher, "encoder"), block_list_prefix(teacher, "decoder")
    assert (enc, dec) == ("encoder.block", "decoder.block")
    wo = "layer.1.DenseReluDense.wo.weight"
    assert torch.equal(s[f"{enc}.0.{wo}"], t[f"{enc}.1.{wo}"])
    bias = "layer.0.SelfAttention.relative_attention_bias.weight"  # only block 0 has it: taken from there
    assert torch.equal(s[f"{enc}.0.{bias}"], t[f"{enc}.0.{bias}"])
    # A student of every block of both stacks is the teacher.
    assert main(["init-student", "--teacher", str(setups["bart"]["teacher"]), "--layers", "1,2",
                 "--out", str(tmp_path / "full")]) == 0
    full = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path / "full")).eval()
    bart = AutoModelForSeq2SeqLM.from_pretrained(str(setups["bart"]["teacher"])).eval()
    ids = torch.tensor([[0, 40, 50, 60, 2]])
    with torch.no_grad():
        assert torch.equal(full(input_ids=ids, decoder_input_ids=ids).logits, bart(input_ids=ids,
                                                                                   decoder_input_ids=ids).logits)


def test_cache_and_student_kinds_must_match(setups, tmp_path):
    gpt2 = make_tiny_gpt2(tmp_path / "gpt2")
    with pytest.raises(CacheCheckError, match="encoder-decoder teacher .* student is not an encoder-decoder"):
        run_training(TrainOptions.of(cache=str(setups["bart"]["cache"]), student=str(gpt2), out=str(tmp_path / "a")))
    single = write_cache(gpt2, tmp_path / "single", num_sequences=8)
    student = make_student_config(tmp_path / "student", setups["bart"]["teacher"], **SHALLOW["bart"])
    with pytest.raises(CacheCheckError, match="holds one token stream"):
        run_training(TrainOptions.of(cache=str(single), student=str(student), out=str(tmp_path / "b")))
    with pytest.raises(CacheCheckError, match="decoder hidden layer map"):
        run_training(TrainOptions.of(cache=str(setups["bart"]["cache"]), student=str(student), out=str(tmp_path / "c"),
                                  decoder_layer_map="explicit:1-7"))


def test_collate_and_cross_attention_kl():
    rng = np.random.default_rng(0)
    seqs = []
    for l_enc, l_dec in ((3, 2), (5, 4)):
        cross = rng.random((2, l_dec, l_enc)).astype(np.float16)
        seqs.append({"encoder/input_ids": np.arange(l_enc, dtype=np.int32),
                     "decoder/input_ids": np.arange(l_dec, dtype=np.int32),
                     "encoder/hidden/1": rng.random((l_enc, 3)).astype(np.float16),
                     "cross_attention/1": cross / cross.sum(-1, keepdims=True),
                     "logits/topk_ids": rng.integers(0, 300, (l_dec, 4)).astype(np.uint16)})
    batch = collate(seqs, [7, 9])
    assert batch["encoder/mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["cross_attention/1"].shape == (2, 2, 4, 5) and batch["encoder/hidden/1"].shape == (2, 5, 3)
    assert batch["logits/topk_ids"].dtype == torch.int64
    np.testing.assert_array_equal(batch["logits/topk_ids"][0, :2].numpy(), seqs[0]["logits/topk_ids"])
    a_t = batch["cross_attention/1"].float()
    zero = cross_attention_kl(a_t, a_t, batch["decoder/mask"], batch["encoder/mask"])
    assert abs(float(zero)) < 1e-6
    a_s = torch.softmax(torch.randn(2, 1, 4, 5), -1)  # one student head vs two teacher heads
    assert float(cross_attention_kl(a_s, a_t, batch["decoder/mask"], batch["encoder/mask"])) > 0


def test_a_two_stream_loss_keeps_the_checkpoint_keys_main_wrote(setups, tmp_path):
    """Each stream's projectors under its name, in the trained module and in ``projectors.pt``, as main's code
    wrote them before issue 57 made the loss one module (``loss_keys_main.json``, see ``test_train_api``)."""
    import kdcache
    from kdcache.stages.train.core.student import load_student
    from kdcache.stages.train.loss import DistillModel

    main_keys = json.loads((Path(__file__).parent / "loss_keys_main.json").read_text())
    folder = make_student_config(tmp_path / "student", setups["bart"]["teacher"], d_model=16, encoder_layers=1,
                                 decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2)
    student = load_student(folder, seed=0)
    with pytest.warns(UserWarning, match="attention implementation was switched"):
        loss = kdcache.DistillationLoss(str(setups["bart"]["cache"]), student, gamma=1.0, delta=1.0)
    trained = sorted(k for k in DistillModel(student, loss).state_dict() if not k.startswith("student."))
    assert trained == main_keys["bart_api"]
    assert sorted(loss.projectors.state_dict()) == main_keys["bart_projectors"]
