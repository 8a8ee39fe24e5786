"""Packing that keeps documents apart: each document of a packed row has the targets it has alone (issue 13).

Real tiny GPT-2, Llama and BERT teachers; the reference is the teacher run on each document by itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kdcache.stages.common.documents import document_attention_mask, document_index
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.rows.packing import RowCounts, iter_rows
from kdcache.stages.precompute.runner import run_precompute
from kdcache.storage import CacheReader, to_float32
from tests.helpers.tiny_models import sample_texts, write_text_dataset

ATOL, RTOL = 2e-3, 2e-3


def _precompute(tmp_path: Path, teacher: Path, texts: list[str], **overrides: Any) -> CacheReader:
    data = write_text_dataset(tmp_path / "data.jsonl", texts)
    opts = dict(teacher=str(teacher), data=str(data), out=str(tmp_path / "cache"), max_length=40, batch_size=3,
                sequences_per_shard=4, progress=False, packing="documents")
    opts.update(overrides)
    run_precompute(PrecomputeOptions.of(**opts))
    return CacheReader(tmp_path / "cache")


def _documents(item: dict[str, np.ndarray]) -> list[slice]:
    starts = [int(i) for i in np.flatnonzero(item["position_ids"] == 0)] + [len(item["position_ids"])]
    return [slice(a, b) for a, b in zip(starts, starts[1:])]


def _alone(teacher: Path, ids: np.ndarray, cls_name: str) -> Any:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(str(teacher), attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(ids[None].astype(np.int64)), output_hidden_states=True, output_attentions=True)


@pytest.mark.parametrize("family,cls_name", [("gpt2", "AutoModelForCausalLM"), ("llama", "AutoModelForCausalLM"),
                                             ("bert", "AutoModelForMaskedLM")])
def test_each_packed_document_equals_the_document_alone(family: str, cls_name: str, tmp_path: Path,
                                                        request: pytest.FixtureRequest) -> None:
    teacher = request.getfixturevalue(f"tiny_{family}")
    features = ("hidden", "attention", "logits")
    reader = _precompute(tmp_path, teacher, sample_texts(24, seed=3), layers=("1", "-1"), features=features,
                         top_k=8)
    assert reader.spec.token_arrays == ("loss_mask", "position_ids")
    multi = 0
    for i in range(len(reader)):
        item = reader[i]
        docs = _documents(item)
        multi += len(docs) > 1
        assert (item["loss_mask"] == 1).all()
        for doc in docs:
            ref = _alone(teacher, item["input_ids"][doc], cls_name)
            for j in reader.spec.hidden_layers:
                np.testing.assert_allclose(to_float32(item[f"hidden/{j}"][doc], "fp16"), ref.hidden_states[j][0],
                                           rtol=RTOL, atol=ATOL, err_msg=f"row {i} {doc} hidden/{j}")
            for j in reader.spec.attention_layers:
                block = to_float32(item[f"attention/{j}"], "fp16")[:, doc, doc]
                np.testing.assert_allclose(block, ref.attentions[j - 1][0], rtol=RTOL, atol=ATOL)
                assert to_float32(item[f"attention/{j}"], "fp16")[:, doc].sum(-1) == pytest.approx(1, abs=3e-3)
            np.testing.assert_allclose(item["logits/lse"][doc], torch.logsumexp(ref.logits[0], -1),
                                       rtol=1e-4, atol=1e-4)
            np.testing.assert_array_equal(item["logits/topk_ids"][doc][:, 0], ref.logits[0].argmax(-1))
    assert multi >= 2, "the test data must pack several documents into a row"
    shard = reader.read_shard(0, ["attention"])  # stored per document: each document's square, nothing between
    rows = np.diff(shard.attention_offsets)  # the attention stream's own offsets, as ``all_offsets`` holds them
    squares = [sum((sl.stop - sl.start) ** 2 for sl in _documents(shard.sequence(i)))
               for i in range(len(shard))]
    assert rows.tolist() == squares and "position_ids" in shard.arrays


def test_rows_keep_documents_whole_and_lose_no_token() -> None:
    docs = [([1, 2, 3], np.ones(3, np.uint8)), None, ([4] * 9, np.ones(9, np.uint8)), ([5, 6], np.zeros(2, np.uint8)),
            ([7, 8], np.array([0, 1], np.uint8))]
    counts = RowCounts()
    rows = list(iter_rows(docs, counts, "documents", block=5, eos=0))
    # [1 2 3 eos] | [4 4 4 4 4] [4 4 4 4 eos] | [7 8 eos]: a document too long for a row becomes row-sized pieces.
    assert [ids.tolist() for ids, *_ in rows] == [[1, 2, 3, 0], [4] * 5, [4, 4, 4, 4, 0], [7, 8, 0]]
    assert [p.tolist() for _, _, p, _ in rows] == [[0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2]]
    assert rows[-1][1].tolist() == [0, 1, 1] and (counts.dropped_empty, counts.dropped_untrained) == (1, 1)
    concat = list(iter_rows(docs, RowCounts(), "concat", block=5, eos=0))
    assert [ids.tolist() for ids, *_ in concat] == [[1, 2, 3, 0, 4], [4] * 5, [4, 4, 4, 0, 7], [8, 0]]
    assert all(positions is None for _, _, positions, _ in concat)


def test_document_mask_is_block_diagonal_and_causal() -> None:
    positions = torch.tensor([[0, 1, 0, 1, 2, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    assert document_index(positions).tolist() == [[1, 1, 2, 2, 2, 3]]
    allowed = document_attention_mask(positions, mask, causal=True, dtype=torch.float32)[0, 0] == 0
    assert allowed[:5, :5].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0],
                                              [0, 0, 1, 1, 1]]
    assert allowed[5].int().tolist() == [0, 0, 0, 0, 0, 1] and not allowed[:5, 5].any()


def test_the_student_sees_the_same_document_boundaries(tiny_gpt2: Path, tmp_path: Path) -> None:
    """Stage two runs packed rows as stage one did: the teacher scored as its own student matches its cache in
    every document (it would not, past the first, if attention crossed documents)."""
    from transformers import AutoModelForCausalLM

    from kdcache.stages.common.option_groups import assemble
    from kdcache.stages.train.core.options import LossOptions
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.objective.compound import CompoundLoss
    from kdcache.stages.train.objective.distill import student_inputs

    reader = _precompute(tmp_path, tiny_gpt2, sample_texts(24, seed=4), layers=("2", "3"), features=("hidden", "logits"),
                         top_k=16)
    batch = to_device(collate([reader[i] for i in range(4)], range(4)), "cpu")
    assert int((batch["position_ids"] == 0).sum()) > 6  # several documents per row
    model = AutoModelForCausalLM.from_pretrained(str(tiny_gpt2)).eval()
    with torch.no_grad():
        out = model(**student_inputs(model, batch), output_hidden_states=True)
        options = assemble(LossOptions, {"gamma": 1.0, "hidden_loss": "cka", "topk_kl": "other", "temperature": 1.0})
        terms = CompoundLoss(options, layer_map=[(2, 2), (3, 3)])(out, batch, batch["mask"])
    real = batch["mask"].bool()
    for j in (2, 3):
        np.testing.assert_allclose(out.hidden_states[j][real], batch[f"hidden/{j}"][real], rtol=RTOL, atol=ATOL)
    assert float(terms["topk_kl"]) < 1e-3 and float(terms["hidden"]) < 1e-3
    with torch.no_grad():  # the same rows without the document mask: later documents see earlier ones
        crossed = model(input_ids=batch["input_ids"], attention_mask=batch["mask"], output_hidden_states=True)
    assert not torch.allclose(crossed.hidden_states[3][real], batch["hidden/3"][real], atol=1e-2)


def test_a_teacher_that_cannot_keep_documents_apart_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """RoBERTa counts positions from its padding id, so restarting positions are not its own: refused, named."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    from kdcache.pipeline.cli import main
    from tests.helpers.tiny_models import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(tmp_path / "roberta")
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=130, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    RobertaForMaskedLM(config).save_pretrained(str(tmp_path / "roberta"))
    data = write_text_dataset(tmp_path / "d.jsonl", sample_texts(12, seed=1))
    assert main(["precompute", "--teacher", str(tmp_path / "roberta"), "--data", str(data), "--out",
                 str(tmp_path / "cache"), "--packing", "--max-length", "40", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "packing documents: RobertaForMaskedLM does not keep packed documents apart" in err
    assert "Traceback" not in err


def test_a_student_that_cannot_keep_documents_apart_is_refused(tiny_gpt2: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, RobertaConfig, RobertaModel

    from kdcache.stages.common.loss_errors import LossError
    from kdcache.stages.train.feed.streaming import collate, to_device
    from kdcache.stages.train.objective.distill import check_documents_apart

    reader = _precompute(tmp_path, tiny_gpt2, sample_texts(24, seed=4), layers=("1",), features=("hidden",))
    batch = to_device(collate([reader[i] for i in range(4)], range(4)), "cpu")
    check_documents_apart(AutoModelForCausalLM.from_pretrained(str(tiny_gpt2)).train(), batch)  # no error
    roberta = RobertaModel(RobertaConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=130, pad_token_id=2))
    with pytest.raises(LossError, match="the student RobertaModel does not keep them apart"):
        check_documents_apart(roberta.train(), batch)
    assert roberta.training  # put back as it was


def test_a_sliding_window_shorter_than_the_rows_is_named() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    from kdcache.stages.common.documents import documents_apart_problem

    def mistral(window: int | None) -> MistralForCausalLM:
        return MistralForCausalLM(MistralConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                                sliding_window=window)).eval()

    ids, mask = torch.randint(0, 100, (1, 12)), torch.ones(1, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert "sliding window of 8 tokens" in documents_apart_problem(mistral(8), ids, mask, positions, causal=True)
        assert documents_apart_problem(mistral(None), ids, mask, positions, causal=True) is None
