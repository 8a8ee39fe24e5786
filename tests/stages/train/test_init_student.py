"""``kdcache init-student``: students made of copied teacher blocks, and training one of them from a cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kdcache.pipeline.cli import main
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.core.student import load_student
from kdcache.stages.train.init_student import block_list_prefix, init_student_from_teacher
from kdcache.stages.train.logging import read_jsonl
from kdcache.stages.train.loop import run_training
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2, make_tiny_llama
from tests.stages.train._train_support import write_cache

BUILDERS = {"gpt2": make_tiny_gpt2, "llama": make_tiny_llama, "bert": make_tiny_bert}


@pytest.fixture(scope="module")
def teachers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("init")
    out = {name: build(root / name, layers=3) for name, build in BUILDERS.items()}
    # A dropout-free BERT, so that a student copied whole reproduces the cached targets exactly.
    out["bert-nodrop"] = make_tiny_bert(root / "bert-nodrop", layers=2, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    return out


@pytest.mark.parametrize("name", list(BUILDERS))
def test_student_blocks_are_copies_of_the_chosen_teacher_blocks(name: str, teachers: dict[str, Path],
                                                                tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = init_student_from_teacher(teachers[name], [1, 3], tmp_path / "student")
    teacher, student = load_student(teachers[name]), load_student(out)  # their own classes, heads included
    assert student.config.num_hidden_layers == 2
    prefix = block_list_prefix(teacher)
    t_state, s_state = teacher.state_dict(), student.state_dict()
    for key, value in s_state.items():
        source = key
        if key.startswith(prefix + "."):
            index, rest = key[len(prefix) + 1:].split(".", 1)
            source = f"{prefix}.{[0, 2][int(index)]}.{rest}"
        assert torch.equal(value, t_state[source]), key
    ids = torch.tensor([[4, 5, 6, 7, 8]])
    assert torch.allclose(teacher(ids, output_hidden_states=True).hidden_states[1],
                          student(ids, output_hidden_states=True).hidden_states[1], atol=1e-6)
    assert len(AutoTokenizer.from_pretrained(str(out))) == len(AutoTokenizer.from_pretrained(str(teachers[name])))


def test_cli_init_student_and_its_errors(teachers: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    teacher = str(teachers["gpt2"])
    assert main(["init-student", "--teacher", teacher, "--layers", "2", "--out", str(tmp_path / "s")]) == 0
    assert (tmp_path / "s" / "config.json").is_file() and (tmp_path / "s" / "tokenizer.json").is_file()
    assert main(["init-student", "--teacher", teacher, "--layers", "1,9", "--out", str(tmp_path / "x")]) == 2
    assert "must be teacher blocks 1..3; out of range: [9]" in capsys.readouterr().err
    assert main(["init-student", "--teacher", teacher, "--layers", "one", "--out", str(tmp_path / "x")]) == 2
    assert "expected comma-separated block numbers" in capsys.readouterr().err


def test_init_student_writes_only_into_a_new_or_empty_folder(teachers: dict[str, Path], tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Into a cache, over a student, over a file or among other files: exit 2, one line naming the folder, and
    nothing there changed."""
    teacher = str(teachers["gpt2"])
    cache = write_cache(teachers["gpt2"], tmp_path / "cache", num_sequences=4, sequences_per_shard=4)
    assert main(["init-student", "--teacher", teacher, "--layers", "2", "--out", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    cases = {cache: "is a kdcache cache", tmp_path / "s": "already holds a student built by init-student",
             tmp_path / "notes": "is not empty (found todo.txt)", tmp_path / "file": "is a file"}
    for out, words in cases.items():
        before = {p: p.stat().st_mtime_ns for p in [out, *out.rglob("*")]}
        assert main(["init-student", "--teacher", teacher, "--layers", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {str(out)!r} {words}" in err and "Traceback" not in err
        assert {p: p.stat().st_mtime_ns for p in [out, *out.rglob("*")]} == before
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["init-student", "--teacher", teacher, "--layers", "1", "--out", str(empty)]) == 0


def test_a_whole_copy_of_the_teacher_matches_its_cache_and_trains(teachers: dict[str, Path], tmp_path: Path) -> None:
    """Encoder path (BERT, per-token CE): a student identical to the teacher has ~0 distillation loss."""
    teacher = teachers["bert-nodrop"]
    cache = write_cache(teacher, tmp_path / "cache", num_sequences=16, sequences_per_shard=4)
    student = init_student_from_teacher(teacher, [1, 2], tmp_path / "student")
    options = TrainOptions.of(cache=str(cache), student=str(student), out=str(tmp_path / "run"), batch_size=4,
                           max_steps=2, log_every=1, lr=1e-3, beta=1.0, gamma=1.0, delta=1.0, temperature=1.0,
                           hidden_loss="mse", layer_map="uniform")
    summary = run_training(options)
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["hidden"] < 1e-5 and first["attention"] < 1e-4 and first["topk_kl"] < 1e-3
    assert summary["steps"] == 2 and (tmp_path / "run" / "student" / "config.json").is_file()


def test_encoder_decoder_teachers_load_with_their_lm_head_whatever_architectures_say() -> None:
    """bart-base's config names its bare BartModel: stage one and init-student still need the LM head."""
    import transformers

    from kdcache.stages.common.architectures import lm_class, model_class

    config = transformers.BartConfig(architectures=["BartModel"])
    assert model_class(config) is transformers.BartModel  # a student loads as the class its config names
    assert lm_class(config) is transformers.AutoModelForSeq2SeqLM
    assert lm_class(transformers.GPT2Config(architectures=["GPT2LMHeadModel"])) is transformers.GPT2LMHeadModel


def test_a_lora_adapter_folder_loads_with_the_maps_attention(tmp_path: Path) -> None:
    """An adapter folder (a LoRA student's ``save_model``) loads with ``kdcache_maps``, which the attention term
    asks for: the implementation is registered before either way of loading. A fresh process, because the
    registration is global and an earlier test in this one may have made it already."""
    import subprocess
    import sys

    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = make_tiny_gpt2(tmp_path / "base", layers=2)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                peft.LoraConfig(r=2, target_modules=["c_attn"]))
    model.save_pretrained(tmp_path / "adapter")
    code = ("import sys; from kdcache.stages.train.core.student import load_student; "
            "print(load_student(sys.argv[1], attn_implementation='kdcache_maps').config._attn_implementation)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "adapter")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "kdcache_maps", done.stderr[-2000:]
