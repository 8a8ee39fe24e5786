"""``kdcache precompute`` from the command line: flags, YAML, and every bad input as exit 2 without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdcache.pipeline.cli import build_parser, main
from kdcache.pipeline.config import ConfigError, build
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import sample_texts, write_text_dataset

CONTRACT_FLAGS = ("--teacher", "--data", "--out", "--split", "--text-column", "--max-length", "--layers",
                  "--features", "--top-k", "--full-logits", "--heads", "--format", "--batch-size", "--dtype",
                  "--codec", "--num-shards", "--shard-index", "--config")


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "data.jsonl", sample_texts(12, seed=21))


def _run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main(["precompute", "--no-progress", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _bad(capsys: pytest.CaptureFixture, *argv: str) -> str:
    code, _, err = _run(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err and "kdcache precompute: error:" in err
    return err


def test_contract_flags_exist() -> None:
    helps = build_parser()._subparsers._group_actions[0].choices["precompute"].format_help()
    for flag in CONTRACT_FLAGS:
        assert flag in helps, flag


def test_cli_run_and_yaml_config(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    config = tmp_path / "kd.yaml"
    config.write_text(f"precompute:\n  teacher: {tiny_gpt2}\n  data: {corpus}\n  layers: [1, 3]\n  top_k: 4\n"
                      f"  features: [hidden, logits]\n  format: arrow\n")
    out = tmp_path / "cache"
    code, stdout, err = _run(capsys, "--config", str(config), "--out", str(out), "--top-k", "5", "--json")
    assert code == 0, err
    summary = json.loads(stdout)
    assert summary["status"] == "complete" and set(summary["bytes_per_token"]) >= {"hidden/1", "logits/topk"}
    spec = CacheReader(out).spec
    assert (spec.hidden_layers, spec.top_k, spec.backend) == ((1, 3), 5, "arrow")  # the flag beat the YAML
    assert (out / "tokenizer" / "tokenizer.json").is_file()


def test_missing_teacher_path(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _bad(capsys, "--teacher", str(tmp_path / "nope"), "--data", str(corpus), "--out", str(tmp_path / "c"))
    assert "does not exist" in err and "nope" in err


def test_empty_dataset(tiny_gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    nothing = tmp_path / "d.jsonl"
    nothing.write_text("")
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(nothing), "--out", str(tmp_path / "c"))
    assert "is empty" in err
    header_only = tmp_path / "d.csv"
    header_only.write_text("text\n")
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(header_only), "--out", str(tmp_path / "c"))
    assert "is empty" in err


def test_blank_texts_only(tiny_gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blank = write_text_dataset(tmp_path / "blank.jsonl", ["", "   "])
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(blank), "--out", str(tmp_path / "c"))
    assert "no row of column 'text' produced a token" in err and "2 empty" in err


def test_missing_text_column_lists_columns(tiny_gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = write_text_dataset(tmp_path / "d.jsonl", ["hello world"], column="content")
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(tmp_path / "c"))
    assert "no column 'text'" in err and "content" in err


def test_layer_out_of_range(tiny_gpt2: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(tmp_path / "c"),
               "--layers", "2,9")
    assert "layer 9 is out of range" in err and "0..3" in err


def test_top_k_larger_than_vocab(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(tmp_path / "c"),
               "--top-k", "1000")
    assert "top_k 1000" in err and "320" in err


def test_head_out_of_range_and_no_lm_head(minilm: Path, corpus: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    err = _bad(capsys, "--teacher", str(minilm), "--data", str(corpus), "--out", str(tmp_path / "c"),
               "--features", "hidden,attention", "--heads", "12")
    assert "head 12 is out of range" in err
    err = _bad(capsys, "--teacher", str(minilm), "--data", str(corpus), "--out", str(tmp_path / "c"),
               "--features", "hidden,logits")
    assert "no language-model head" in err


def test_default_features_follow_the_teacher(minilm: Path, tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """No --features: an encoder without an LM head caches hidden states; a causal LM adds its logits."""
    for teacher, out, features in ((minilm, "encoder", ("hidden",)), (tiny_gpt2, "causal", ("hidden", "logits/topk"))):
        code, _, err = _run(capsys, "--teacher", str(teacher), "--data", str(corpus), "--out", str(tmp_path / out),
                            "--layers", "1")
        assert code == 0, err
        assert CacheReader(tmp_path / out).features == features


def test_unwritable_output(tiny_gpt2: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(blocker / "cache"))
    assert "not a folder" in err


def test_output_holding_a_different_cache(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    args = ["--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(tmp_path / "c"), "--top-k", "4"]
    assert _run(capsys, *args, "--layers", "1")[0] == 0
    err = _bad(capsys, *args, "--layers", "2")
    assert "already holds a different cache" in err and "hidden_layers" in err


def test_output_folder_with_other_files(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(tmp_path / "c"))
    assert "holds no kdcache cache" in err


def test_validate_lists_every_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        build(PrecomputeOptions, {"teacher": str(tmp_path / "missing"), "data": str(tmp_path / "none.jsonl"),
                                  "out": str(tmp_path / "o"), "features": "hidden,logitz", "batch_size": 0,
                                  "shard_index": 3, "num_shards": 2, "layers": "1,x", "codec": "nosuchcodec"})
    text = str(info.value)
    for piece in ("features", "batch_size", "shard_index", "layers", "codec", "teacher", "data"):
        assert piece in text, piece
    assert len(info.value.problems) == 7


def test_merge_of_a_folder_without_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["merge", str(tmp_path)]) == 2
    assert "no kdcache cache" in capsys.readouterr().err


@pytest.mark.parametrize("codec", ['{"name": "int8", "configuration": {"group": "x"}}',
                                   '{"name": "int8", "configuration": {"outliers": null}}'])
def test_hidden_codec_with_a_badly_typed_value(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture, codec: str) -> None:
    err = _bad(capsys, "--teacher", str(tiny_gpt2), "--data", str(corpus), "--out", str(tmp_path / "c"),
               "--features", "hidden", "--hidden-codec", codec)
    assert "hidden_codec" in err


def test_a_mistyped_data_file_is_named_as_missing_and_the_hub_tried_once(tiny_gpt2: Path, tmp_path: Path) -> None:
    """``data/trian.jsnol`` reads as a hub name too: the error says no such local file exists, and an unreachable
    hub is tried once (then its cache only), not retried for most of a minute."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens there: the connection is refused at once
    proc = subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", str(tiny_gpt2), "--data",
                           "data/trian.jsnol", "--out", str(tmp_path / "out")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "there is no local file or folder 'data/trian.jsnol'" in proc.stderr
    assert "the hub (http://127.0.0.1:9) cannot be reached" in proc.stderr and "Traceback" not in proc.stderr
    assert "give --data a local data file (.json, .jsonl, .csv" in proc.stderr, proc.stderr[-2000:]
    assert "download dataset 'data/trian.jsnol'" in proc.stderr and "model folder" not in proc.stderr
    assert not (tmp_path / "out").exists()
