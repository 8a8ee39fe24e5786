"""Does our EAGLE-3 export load with speculators' own EAGLE-3 class, and does its forward equal ours? (issue 59)

Two environments, one script:

1. ``--side ours`` (the project's .venv): a random draft built with kdcache's classes (every weight random, norms
   included, so that a name or layout mix-up shows), exported with ``export_draft`` as ``kdcache draft`` writes it,
   and our training-time-test forward (``Eagle3Draft.unrolled``) on random target features and ids, in float64.
   Writes ``<work>/draft/`` and ``<work>/case.pt`` (inputs, the target embedding, our logits per step).
2. ``--side theirs`` (speculators' venv, ``setup.sh``): ``Eagle3DraftModel.from_pretrained(<work>/draft)``, which
   loads the embedding from the verifier the config names (a tiny Llama saved in ``<work>/target`` over the same
   embedding: the export leaves it to the target, as vLLM does), then speculators' own forward on the same inputs
   with its logits of every step caught at ``lm_head``; compares them with ours, and the layer ids we wrote with
   the ones speculators' trainer picks for that target by default.

Default (no ``--side``): runs ours here, then theirs with ``benchmarks/speculators_check/.venv/bin/python``, and
prints the verdict as JSON. Not part of ``make test``: speculators pins another transformers than the project.

Usage: ``bash benchmarks/speculators_check/setup.sh && .venv/bin/python benchmarks/speculators_check/check_export.py``
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STEPS, LENGTH, VOCAB, HIDDEN, DRAFT_VOCAB = 3, 12, 96, 32, 40
# Both sides run in float64, but transformers' Llama layer (speculators' decoder layer) takes its rotary angles and
# its eager softmax in float32: float32 rounding (~1e-7 of the logits' scale) is the floor. A wrong name, norm,
# mask or position shows at the logits' own scale.
BOUND = 1e-5


def ours(work: Path) -> None:
    """The project side (module docstring, 1)."""
    sys.path.insert(0, str(REPO))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kdcache.stages.draft.export import export_draft
    from kdcache.stages.draft.model import DraftShape, Eagle3Draft
    from kdcache.stages.draft.vocab import DraftVocab

    g = torch.Generator().manual_seed(0)
    embedding = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    words = DraftVocab.most_frequent(torch.randint(0, 50, (VOCAB,), generator=g), DRAFT_VOCAB)
    shape = DraftShape(HIDDEN, VOCAB, DRAFT_VOCAB, num_heads=4, intermediate_size=64, layers=(2, 4, 5))
    draft = Eagle3Draft(shape, embedding, words.d2t, words.t2d).double()
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.startswith("embed_tokens."):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.3 if p.dim() > 1 else 0.5) +
                        (1.0 if p.dim() == 1 else 0.0))
    features = torch.randn(1, LENGTH, 3 * HIDDEN, generator=g, dtype=torch.float64)
    ids = torch.randint(1, VOCAB, (1, LENGTH), generator=g)
    with torch.no_grad():
        logits = draft.eval().unrolled(features, ids, STEPS)
    # The verifier: an 8-block Llama of the same sizes over our embedding. speculators resolves the layer ids
    # against its config and loads the embedding from its weights (our export leaves it out).
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=8, num_attention_heads=4,
                         intermediate_size=64, architectures=["LlamaForCausalLM"])
    verifier = LlamaForCausalLM(config).double()
    with torch.no_grad():
        verifier.get_input_embeddings().weight.copy_(embedding)
    verifier.save_pretrained(work / "target")
    target = {"num_blocks": 8, "name_or_path": str(work / "target"), "architectures": ["LlamaForCausalLM"],
              "max_positions": 2048}
    export_draft(draft, work / "draft", target, ttt_steps=STEPS)
    export_draft(draft, work / "draft-sglang", target, ttt_steps=STEPS, layout="sglang")
    torch.save({"features": features, "ids": ids, "embedding": embedding, "logits": torch.stack(logits)},
               work / "case.pt")


def _their_logits(folder: Path, case: dict[str, Any]) -> tuple[Any, bool, bool]:
    """speculators' ``Eagle3DraftModel`` loaded from ``folder``: its logits ``[steps, L, N]`` on the case's inputs,
    whether ``from_pretrained`` took the verifier's embedding by itself, and whether it holds it now."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    config = Eagle3DraftModel.config_class.from_pretrained(str(folder))
    # speculators' eager attention (its dense TTT mask): its default flex attention wants 128-token blocks.
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(folder), config=config, torch_dtype=torch.float64)
    # speculators fills the embedding from the verifier only where it reads NaN after loading (it takes a missing
    # weight for uninitialised memory), which held in one of our runs and not the next: take it from the verifier
    # with speculators' own loader, always.
    loaded_by_itself = bool(torch.equal(model.embed_tokens.weight.detach(), case["embedding"]))
    model._load_verifier_weights(overwrite_embed_tokens=True)
    model = model.double().eval()
    caught: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: caught.append(out.detach()))
    ids = case["ids"]
    # Their step 0 reads the next token at each position (their data loader shifts it); ours shifts inside.
    shifted = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=-1)
    with torch.no_grad():
        model(hidden_states=case["features"], input_ids=shifted, document_ids=torch.zeros_like(ids),
              ttt_steps=STEPS)
    return (torch.stack(caught)[:, 0], loaded_by_itself,
            bool(torch.equal(model.embed_tokens.weight.detach(), case["embedding"])))


def _compare(theirs_logits: Any, case: dict[str, Any]) -> dict[str, Any]:
    """Max differences per step over the positions both define (past the end, steps >= 1 read padding)."""
    ours_logits = case["logits"][:, 0]
    scale = float(ours_logits.abs().max())
    diffs = [float((theirs_logits[k, :LENGTH - 1 - k] - ours_logits[k, :LENGTH - 1 - k]).abs().max())
             for k in range(STEPS)]
    return {"max_abs_diff_per_step": diffs, "logit_scale": scale, "equal": all(d <= BOUND * scale for d in diffs)}


def theirs(work: Path) -> dict[str, Any]:
    """The speculators side (module docstring, 2): the verdict as a dict."""
    import torch
    import transformers
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.utils import resolve_target_layer_ids

    case = torch.load(work / "case.pt")
    direct, by_itself, embedded = _their_logits(work / "draft", case)
    # The SGLang layout is the original EAGLE-3 checkpoint's: speculators' converter for those reads it.
    Eagle3Converter().convert(work / "draft-sglang", work / "converted", base_model=str(work / "target"),
                              validate=False, eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    converted, _, converted_embedded = _their_logits(work / "converted", case)
    # speculators' own default layers for this target (what its trainer captures) against the ids we wrote.
    default = resolve_target_layer_ids(None, str(work / "target"))
    written = json.loads((work / "draft" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    result = {"transformers": transformers.__version__, "bound": BOUND, "layer_ids": written,
              "their_default_layer_ids": default, "embedding_from_verifier": embedded and converted_embedded,
              "embedding_loaded_by_from_pretrained": by_itself,
              "speculators_layout": _compare(direct, case), "sglang_layout_converted": _compare(converted, case)}
    result["pass"] = (result["speculators_layout"]["equal"] and result["sglang_layout_converted"]["equal"]
                      and result["embedding_from_verifier"] and list(default) == written)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours", "theirs"], default=None)
    parser.add_argument("--work", default="/tmp/kdcache-speculators-check")
    parser.add_argument("--python", default=str(HERE / ".venv" / "bin" / "python"), help="speculators' venv")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.side == "theirs":
        print(json.dumps(theirs(work)))
        return
    ours(work)
    if args.side == "ours":
        return
    done = subprocess.run([args.python, __file__, "--side", "theirs", "--work", str(work)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        sys.exit(done.returncode)
    print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
