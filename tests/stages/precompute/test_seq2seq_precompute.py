"""Stage one for encoder-decoder teachers (issue 6): tiny random BART and T5, cache == online teacher.

The online reference runs each pair alone (no padding) through the teacher, teacher-forced on its target with
the model's own label shift; the cache was written from padded, length-bucketed batches. They must agree within
fp16 rounding on every stored target.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.storage import CacheReader, to_float32
from kdcache.storage.core.errors import Fp16OverflowError
from tests.helpers.tiny_models import make_tiny_bart, make_tiny_gpt2, make_tiny_t5, sample_pairs, write_pair_dataset

FEATURES = "hidden,attention,cross_attention,logits"


def precompute(teacher: Path, data: Path, out: Path, *extra: str) -> int:
    argv = ["precompute", "--teacher", str(teacher), "--data", str(data), "--out", str(out), "--source-column",
            "source", "--target-column", "target", "--max-length", "32", "--sequences-per-shard", "4",
            "--batch-size", "3", "--no-progress", *extra]
    return main(argv)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_pair_dataset(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", sample_pairs(10))


@pytest.fixture(scope="module")
def seq2seq_teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("seq2seq-teachers")
    return {"bart": make_tiny_bart(root / "bart"), "t5": make_tiny_t5(root / "t5", gated=True)}


def online(teacher: Path, source: list[int], target: list[int]) -> dict[str, np.ndarray]:
    """One pair through the teacher alone: every output the cache may hold, float32."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(str(teacher), attn_implementation="eager").eval()
    labels = torch.tensor([target])
    with torch.no_grad():
        out = model(input_ids=torch.tensor([source]), decoder_input_ids=model.prepare_decoder_input_ids_from_labels(
            labels=labels), output_hidden_states=True, output_attentions=True)
    ref = {"logits": out.logits[0].numpy()}
    for side in ("encoder", "decoder"):
        ref.update({f"{side}/hidden/{j}": h[0].numpy() for j, h in enumerate(getattr(out, f"{side}_hidden_states"))})
        ref.update({f"{side}/attention/{j + 1}": a[0].numpy()
                    for j, a in enumerate(getattr(out, f"{side}_attentions"))})
    ref.update({f"cross_attention/{j + 1}": a[0].numpy() for j, a in enumerate(out.cross_attentions)})
    return ref


def assert_close_fp16(got: np.ndarray, want: np.ndarray, name: str) -> None:
    # fp16 keeps 11 significant bits: relative 2**-11, plus batching noise of the fp32 forward.
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * max(1.0, float(np.abs(want).max())), err_msg=name)


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_cached_targets_equal_the_online_teacher(name, seq2seq_teachers, pairs_file, tmp_path):
    teacher = seq2seq_teachers[name]
    assert precompute(teacher, pairs_file, tmp_path / "cache", "--features", FEATURES, "--top-k", "6",
                      "--triangle") == 0
    reader = CacheReader(tmp_path / "cache")
    spec = reader.spec
    assert spec.is_encoder_decoder and reader.manifest.format_version == 4 and reader.num_sequences == 10
    assert spec.layers_of("hidden", "encoder") == (0, 1, 2) and spec.layers_of("cross_attention", "decoder") == (1, 2)
    assert reader.fingerprints["teacher"]["num_decoder_layers"] == 2
    for i in (0, 3, 7):
        item = reader[i]
        ref = online(teacher, item["encoder/input_ids"].tolist(), item["decoder/input_ids"].tolist())
        for array in spec.sequence_names():
            if array in spec.token_names() or array.startswith("logits/"):
                continue
            want = np.tril(ref[array]) if array.startswith("decoder/attention/") else ref[array]
            assert_close_fp16(to_float32(item[array], spec.dtype), want, f"{name} seq {i} {array}")
        logits = torch.from_numpy(ref["logits"])
        assert_close_fp16(to_float32(item["logits/topk_values"], "fp16"), logits.topk(6).values.numpy(), "topk")
        np.testing.assert_allclose(item["logits/lse"], torch.logsumexp(logits, -1).numpy(), rtol=1e-5, atol=1e-5)


def test_per_side_layer_flags_and_resume(seq2seq_teachers, pairs_file, tmp_path, capsys):
    args = ("--features", "hidden,cross_attention,logits", "--encoder-layers", "2", "--decoder-layers", "none",
            "--cross-attention-layers", "1", "--full-logits", "--dtype", "bf16")
    assert precompute(seq2seq_teachers["bart"], pairs_file, tmp_path / "c", *args) == 0
    spec = CacheReader(tmp_path / "c").spec
    assert (spec.layers_of("hidden", "encoder"), spec.layers_of("hidden", "decoder"),
            spec.layers_of("cross_attention", "decoder")) == ((2,), (), (1,))
    assert spec.logits == "full" and spec.dtype == "bf16" and not spec.layers_of("attention", "encoder")
    before = [r.checksum for r in CacheReader(tmp_path / "c").records]
    capsys.readouterr()
    assert precompute(seq2seq_teachers["bart"], pairs_file, tmp_path / "c", *args) == 0  # nothing left to do
    assert "0 shard(s) written, 3 already committed" in capsys.readouterr().out
    assert [r.checksum for r in CacheReader(tmp_path / "c").records] == before
    assert main(["inspect", str(tmp_path / "c")]) == 0  # per-stream layers, not "none"
    text = capsys.readouterr().out
    assert "encoder hidden layers [2]" in text and "decoder hidden layers none" in text
    assert "cross-attn   layers [1]" in text


def test_seq2seq_options_are_checked(seq2seq_teachers, pairs_file, tmp_path, capsys):
    assert main(["precompute", "--teacher", str(seq2seq_teachers["t5"]), "--data", str(pairs_file), "--out",
                 str(tmp_path / "a"), "--no-progress"]) == 2
    assert "--target-column" in capsys.readouterr().err
    gpt2 = make_tiny_gpt2(tmp_path / "gpt2")
    assert main(["precompute", "--teacher", str(gpt2), "--data", str(pairs_file), "--out", str(tmp_path / "b"),
                 "--text-column", "source", "--target-column", "target", "--no-progress"]) == 2
    assert "only for encoder-decoder teachers" in capsys.readouterr().err
    assert precompute(seq2seq_teachers["t5"], pairs_file, tmp_path / "c", "--decoder-layers", "7") == 2
    assert "decoder_layers: layer 7 is out of range" in capsys.readouterr().err


def make_overflowing_t5(path: Path) -> Path:
    """A tiny T5 whose encoder block 1 writes values near 1e6 into the residual stream (layer 1), as real
    T5-family models do in fp16; the final RMS norm brings the last layer back into range."""
    from transformers import T5ForConditionalGeneration

    make_tiny_t5(path)
    model = T5ForConditionalGeneration.from_pretrained(str(path))
    with torch.no_grad():
        model.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(1e6)
    model.save_pretrained(str(path))
    return path


def test_fp16_overflow_is_refused_naming_the_layer_and_bf16_stores_it(pairs_file, tmp_path, capsys):
    teacher = make_overflowing_t5(tmp_path / "t5-big")
    args = ("--features", "hidden,logits", "--layers", "1,2")
    with pytest.raises(Fp16OverflowError, match=r"encoder/hidden/1: .*largest \|value\| is .*--dtype bf16") as err:
        from kdcache.stages.precompute.core.options import PrecomputeOptions
        from kdcache.stages.precompute.runner import run_precompute

        run_precompute(PrecomputeOptions.of(teacher=str(teacher), data=str(pairs_file), out=str(tmp_path / "fp16"),
                                         source_column="source", target_column="target", layers=("1", "2"),
                                         progress=False))
    assert err.value.max_abs > 65504 and err.value.name == "encoder/hidden/1"
    assert not list((tmp_path / "fp16" / "shards").glob("shard-*.json"))  # nothing committed
    assert precompute(teacher, pairs_file, tmp_path / "fp16-cli", *args) == 2
    assert "encoder/hidden/1" in capsys.readouterr().err
    assert precompute(teacher, pairs_file, tmp_path / "bf16", *args, "--dtype", "bf16") == 0
    reader = CacheReader(tmp_path / "bf16")
    hidden = to_float32(reader[0]["encoder/hidden/1"], "bf16")
    assert np.isfinite(hidden).all() and np.abs(hidden).max() > 65504
