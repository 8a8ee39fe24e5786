"""A draft from the cache: stage one's draft/ folder, the EAGLE-3 head's training-time test against its drafting,
``kdcache draft`` (DeepSpeed, export) and ``kdcache draft-eval``, and their refusals (exit 2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kdcache.pipeline.cli import main
from kdcache.stages.draft.export import export_draft, load_draft
from kdcache.stages.draft.training import DraftOptions, new_draft
from kdcache.stages.draft.vocab import DraftVocab, restrict_logits, restrict_topk
from kdcache.stages.targets.draft.draft_inputs import read_draft_inputs
from kdcache.storage import CacheReader
from tests.helpers.tiny_models import make_tiny_llama, sample_texts
from tests.stages.train._train_support import precompute_cache

SMALL = {"hidden": 16, "heads": 2, "kv_heads": 1, "intermediate": 32}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An 8-block target, a draft cache of it (head logits), a cache without draft/, a trained draft, prompts."""
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_llama(root / "target", layers=8, **SMALL)
    cache = precompute_cache(target, root / "cache", num_sequences=16,
                             extra=("--layers", "draft", "--features", "hidden,logits", "--logits", "head"))
    plain = precompute_cache(target, root / "plain", num_sequences=8,
                             extra=("--layers", "2,4", "--features", "hidden,logits", "--top-k", "8"))
    out = root / "eagle3"
    assert main(["draft", "--cache", str(cache), "--out", str(out), "--max-steps", "3", "--batch-size", "4",
                 "--draft-vocab", "64", "--ttt-steps", "2"]) == 0
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(sample_texts(2, seed=9)) + "\n")
    return {"target": target, "cache": cache, "plain": plain, "draft": out, "prompts": prompts, "root": root}


def test_draft_cache_holds_the_fused_layers_the_embedding_and_token_counts(made):
    from transformers import AutoModelForCausalLM

    reader = CacheReader(made["cache"])
    assert reader.spec.hidden_layers == (2, 4, 5, 8)  # 2, N/2, N-3, and the head's layer N
    tensors, info = read_draft_inputs(reader.store)
    assert info["layers"] == [2, 4, 5]
    model = AutoModelForCausalLM.from_pretrained(made["target"])
    assert torch.equal(tensors["embedding"], model.get_input_embeddings().weight.detach())
    ids = np.concatenate([reader.get(i, ["input_ids"])["input_ids"] for i in range(len(reader))])
    assert np.array_equal(tensors["token_counts"].numpy(), np.bincount(ids, minlength=info["vocab_size"]))
    assert main(["verify", str(made["cache"])]) == 0  # draft/ is listed with its checksums


def test_training_time_test_is_what_drafting_sees_position_by_position(made):
    # Step k of the unrolled training forward at position t must equal drafting k tokens past t with the true
    # tokens fed in: step 0 over the context, then one position at a time on the draft's own output.
    reader = CacheReader(made["cache"])
    tensors, info = read_draft_inputs(reader.store)
    draft = new_draft(tensors, info, DraftOptions(str(made["cache"]), "-", draft_vocab=64)).double().eval()
    seq = reader.get(0)
    features = torch.cat([torch.from_numpy(seq[f"hidden/{j}"]).double() for j in (2, 4, 5)], -1)[None]
    ids = torch.from_numpy(seq["input_ids"]).long()[None]
    unrolled = draft.unrolled(features, ids, 3)
    t = 6
    past: list = []
    hidden, logits = draft.step(ids[:, 1:t + 2], draft.fuse(features[:, :t + 1]), torch.arange(t + 1), past)
    torch.testing.assert_close(logits[0, -1], unrolled[0][0, t], rtol=0, atol=1e-10)
    for k in (1, 2):
        hidden, logits = draft.step(ids[:, t + 1 + k:t + 2 + k], hidden[:, -1:], torch.tensor([t + k]), past)
        torch.testing.assert_close(logits[0, -1], unrolled[k][0, t], rtol=0, atol=1e-10)


def test_topk_targets_restrict_as_full_logits_do():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g, dtype=torch.float64)
    words = DraftVocab.most_frequent(torch.randint(0, 9, (40,), generator=g), 12)
    full, usable = restrict_logits(logits, words.ids)
    values, ids = logits.sort(-1, descending=True)
    topk, usable_k = restrict_topk(values - logits.logsumexp(-1, keepdim=True), ids, words.index, 12)
    torch.testing.assert_close(topk.double(), full.double(), rtol=0, atol=1e-6)
    assert torch.equal(usable, usable_k)


def test_kdcache_draft_exports_speculators_eagle3_layout(made):
    config = json.loads((made["draft"] / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # HF hidden states, as speculators and vLLM count
    verifier = config["speculators_config"]["verifier"]  # speculators refuses a config without one
    assert verifier == {"name_or_path": str(made["target"]), "architectures": ["LlamaForCausalLM"]}
    names = set(load_file(str(made["draft"] / "model.safetensors")))
    assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= names and not any(n.startswith("embed_tokens") for n in names)
    run = json.loads((made["draft"] / "draft_run.json").read_text())
    assert len(run["losses"]) == 3 and all(np.isfinite(x["loss"]) for x in run["losses"])
    tensors, _ = read_draft_inputs(CacheReader(made["cache"]).store)
    loaded = load_draft(made["draft"], tensors["embedding"])
    assert torch.equal(loaded.fc.weight, load_file(str(made["draft"] / "model.safetensors"))["fc.weight"])


def test_the_sglang_layout_names_the_layer_midlayer_and_counts_blocks_from_zero(made):
    tensors, info = read_draft_inputs(CacheReader(made["cache"]).store)
    draft = load_draft(made["draft"], tensors["embedding"])
    out = made["root"] / "eagle3-sglang"
    export_draft(draft, out, info, ttt_steps=2, layout="sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang captures before id + 1
    names = set(load_file(str(out / "model.safetensors")))
    ours = set(load_file(str(made["draft"] / "model.safetensors")))
    assert names == {n.replace("layers.0.", "midlayer.") for n in ours} and "midlayer.hidden_norm.weight" in names
    back = load_draft(out, tensors["embedding"])
    assert back.shape == draft.shape
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), draft.state_dict().values()))


def test_draft_eval_reports_tau_and_keeps_the_targets_greedy_tokens(made, capsys):
    capsys.readouterr()
    assert main(["draft-eval", "--target", str(made["target"]), "--prompts", str(made["prompts"]), "--draft",
                 str(made["draft"]), "--student", str(made["target"]), "-k", "3", "--max-new", "8", "--json",
                 "--device", "auto"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")  # auto: the GPU where there is one
    assert set(report["drafters"]) == {"prompt lookup", "KD student", "EAGLE-3 head"}
    for figures in report["drafters"].values():
        assert figures["equals_target"] and 1 <= figures["tau"] <= 4 and len(figures["per_position"]) == 3
    assert report["drafters"]["KD student"]["per_position"] == [1.0] * 3  # the target as its own draft: all kept


@pytest.mark.parametrize("case", ["no draft folder", "K below 1", "vocabulary above V", "eval K below 1", "out taken",
                                  "eval device"])
def test_bad_input_exits_2_with_a_clear_message(made, case, capsys):
    cache, out = str(made["cache"]), str(made["root"] / f"bad-{case.replace(' ', '-')}")
    argv, message = {
        "no draft folder": (["draft", "--cache", str(made["plain"]), "--out", out], "no draft/ folder"),
        "K below 1": (["draft", "--cache", cache, "--out", out, "--ttt-steps", "0"], "--ttt-steps: got 0"),
        "vocabulary above V": (["draft", "--cache", cache, "--out", out, "--draft-vocab", "100000"],
                               "--draft-vocab: got 100000, expected 1.."),
        "eval K below 1": (["draft-eval", "--target", str(made["target"]), "--prompts", str(made["prompts"]),
                            "-k", "0"], "-k: got 0, expected at least 1"),
        "out taken": (["draft", "--cache", cache, "--out", str(made["draft"])],
                      "already holds a checkpoint; pass --resume"),
        "eval device": (["draft-eval", "--target", str(made["target"]), "--prompts", str(made["prompts"]),
                         "--device", "tpu9"], "--device: 'tpu9' is not a device"),
    }[case]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert case == "out taken" or not (Path(out) / "config.json").exists()


def test_the_draft_commands_leave_help_light():
    import subprocess
    import sys

    code = ("import sys\nfrom kdcache.pipeline.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n"
            "    pass\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "draft-eval" in out and out.strip().endswith("False")
    # listed after stage two's measures, before the commands that chain the stages (COMMAND_ORDER)
    listed = re.findall(r"^    ([a-z-]+)", out, flags=re.MULTILINE)
    assert listed[listed.index("report"):listed.index("sweep") + 1] == ["report", "draft", "draft-eval", "sweep"]
