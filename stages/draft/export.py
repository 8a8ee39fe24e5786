"""The trained draft in the layouts serving engines load: speculators' (which vLLM reads) or SGLang's.

``speculators`` (the default): ``config.json`` is speculators' ``Eagle3Speculator`` config with a Llama
``transformer_layer_config`` (one layer), ``draft_vocab_size``, ``norm_before_residual: false``,
``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (greedy proposals of
``ttt_steps`` tokens; ``verifier``: the target's name as stage one was given it, and its architectures).
speculators and vLLM number the fused layers as HF's ``hidden_states`` (0 = the embeddings; vLLM captures the input
of block i), so the ids are the cache's layers as they are. Weights: ``fc``, ``layers.0.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``; the embedding is the target's own and left out, as those loaders take it from the target.

``sglang``: the original EAGLE-3 checkpoint layout that SGLang's ``LlamaForCausalLMEagle3`` loads: a flat Llama
config with ``architectures: [LlamaForCausalLMEagle3]`` and ``draft_vocab_size``, the decoder layer's weights
named ``midlayer.*``, and the fused layers in ``eagle_config`` counted as SGLang counts them, block outputs from 0
(it captures before block id + 1), i.e. hidden state j is id j - 1.

Both carry a ``kdcache`` block (the target's depth, the fused hidden layers) from which ``load_draft`` reads
either layout back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kdcache.stages.draft.model import DraftShape, Eagle3Draft
from kdcache.stages.draft.vocab import DraftInputError

LAYOUTS = ("speculators", "sglang")
SGLANG_LAYER = "midlayer."  # SGLang's name for the one decoder layer (ours and speculators': layers.0.)


def _layer_config(shape: DraftShape, target: dict[str, Any]) -> dict[str, Any]:
    """The one Llama decoder layer's config; ``target``: what stage one recorded of the target (``draft.json``)."""
    layer = {"model_type": "llama", "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_heads,
             "num_key_value_heads": shape.num_heads, "head_dim": shape.head_dim, "num_hidden_layers": 1,
             "vocab_size": shape.vocab_size, "rms_norm_eps": shape.rms_norm_eps, "rope_theta": shape.rope_theta,
             "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if target.get("max_positions"):  # unrecorded (a cache from before it was): the loaders' default stands
        layer["max_position_embeddings"] = int(target["max_positions"])
    return layer


def draft_config(shape: DraftShape, target: dict[str, Any], ttt_steps: int = 3, layout: str = "speculators"
                 ) -> dict[str, Any]:
    """``config.json`` for ``shape`` in ``layout`` (module docstring). ``target``: ``num_blocks`` (its depth) and,
    where known, ``name_or_path``, ``architectures``, ``max_positions``."""
    ours = {"kdcache": {"target_blocks": int(target["num_blocks"]), "hidden_layers": list(shape.layers)}}
    layer = _layer_config(shape, target)
    if layout == "sglang":
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": shape.draft_vocab_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [j - 1 for j in shape.layers],
                                 "use_aux_hidden_state": True}, **ours}
    verifier = {"name_or_path": target.get("name_or_path"), "architectures": list(target.get("architectures", []))}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]},
            "draft_vocab_size": shape.draft_vocab_size, "norm_before_residual": False,
            "target_hidden_size": shape.hidden_size, "eagle_aux_hidden_state_layer_ids": list(shape.layers),
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": ttt_steps}],
                                   "verifier": verifier}, **ours}


def export_draft(draft: Eagle3Draft, out: Path, target: dict[str, Any], ttt_steps: int = 3,
                 layout: str = "speculators") -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``out`` (created) in ``layout``; ``target`` as
    ``draft_config`` takes it."""
    if layout not in LAYOUTS:
        raise DraftInputError(f"--layout: got {layout!r}, expected one of {', '.join(LAYOUTS)}")
    rename = SGLANG_LAYER if layout == "sglang" else "layers.0."
    out.mkdir(parents=True, exist_ok=True)
    weights = {rename + k[len("layers.0."):] if k.startswith("layers.0.") else k: v.detach().cpu().contiguous()
               for k, v in draft.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"))
    config = draft_config(draft.shape, target, ttt_steps, layout)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def _shape(config: dict[str, Any]) -> DraftShape:
    """The draft's sizes from either layout's ``config.json``."""
    layer = config.get("transformer_layer_config", config)
    layers = config.get("kdcache", {}).get("hidden_layers") or config["eagle_aux_hidden_state_layer_ids"]
    return DraftShape(layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"],
                      layer["num_attention_heads"], layer["intermediate_size"], tuple(layers),
                      layer["rms_norm_eps"], layer["rope_theta"])


def load_draft(folder: str | Path, embedding: torch.Tensor) -> Eagle3Draft:
    """An exported draft (either layout), over the target's ``embedding [V, d]``.

    Raises:
        DraftInputError: not a draft folder, or a draft of another target width or vocabulary.
    """
    path = Path(folder)
    try:
        config = json.loads((path / "config.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
        shape = _shape(config)
    except (OSError, ValueError, KeyError) as exc:
        raise DraftInputError(f"{str(path)!r} is not an exported draft (config.json and model.safetensors, as "
                              f"`kdcache draft` writes them): {exc!r}") from None
    if tuple(embedding.shape) != (shape.vocab_size, shape.hidden_size):
        raise DraftInputError(f"the draft in {str(path)!r} is for a target of vocabulary {shape.vocab_size} and width "
                              f"{shape.hidden_size}; this target's embedding is {tuple(embedding.shape)}")
    weights = {"layers.0." + k[len(SGLANG_LAYER):] if k.startswith(SGLANG_LAYER) else k: v
               for k, v in weights.items()}
    draft = Eagle3Draft(shape, embedding, weights["d2t"], weights["t2d"])
    draft.load_state_dict(weights, strict=True)
    return draft.eval()
