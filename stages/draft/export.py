"""The trained draft in the layout speculators writes and vLLM loads (``speculators_model_type: eagle3``).

``config.json``: ``Eagle3Speculator`` with a Llama ``transformer_layer_config`` (one layer), ``draft_vocab_size``,
``norm_before_residual: false``, ``target_hidden_size`` and ``eagle_aux_hidden_state_layer_ids`` (block outputs
counted from 0, so hidden state j is id j - 1). ``model.safetensors``: ``fc.weight``, ``layers.0.*``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; the embedding is the target's own and is left out, as those
loaders take it from the target. ``load_draft`` reads the folder back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kdcache.stages.draft.model import DraftShape, Eagle3Draft
from kdcache.stages.draft.vocab import DraftInputError


def draft_config(shape: DraftShape, num_blocks: int, ttt_steps: int = 3) -> dict[str, Any]:
    """``config.json`` for ``shape`` (see the module docstring); ``num_blocks``: the target's depth."""
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": shape.hidden_size,
             "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_heads,
             "num_key_value_heads": shape.num_heads, "head_dim": shape.head_dim, "num_hidden_layers": 1,
             "vocab_size": shape.vocab_size, "rms_norm_eps": shape.rms_norm_eps, "rope_theta": shape.rope_theta,
             "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": layer, "draft_vocab_size": shape.draft_vocab_size,
            "norm_before_residual": False, "target_hidden_size": shape.hidden_size,
            "eagle_aux_hidden_state_layer_ids": [j - 1 for j in shape.layers],
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": ttt_steps}]},
            "kdcache": {"target_blocks": num_blocks, "hidden_layers": list(shape.layers)}}


def export_draft(draft: Eagle3Draft, out: Path, num_blocks: int, ttt_steps: int = 3) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``out`` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()
               if not k.startswith("embed_tokens.")}
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(draft_config(draft.shape, num_blocks, ttt_steps), indent=1) + "\n")


def load_draft(folder: str | Path, embedding: torch.Tensor) -> Eagle3Draft:
    """An exported draft, over the target's ``embedding [V, d]``.

    Raises:
        DraftInputError: not a draft folder, or a draft of another target width or vocabulary.
    """
    path = Path(folder)
    try:
        config = json.loads((path / "config.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError) as exc:
        raise DraftInputError(f"{str(path)!r} is not an exported draft (config.json and model.safetensors, as "
                              f"`kdcache draft` writes them): {exc}") from None
    layer = config["transformer_layer_config"]
    shape = DraftShape(layer["hidden_size"], layer["vocab_size"], config["draft_vocab_size"],
                       layer["num_attention_heads"], layer["intermediate_size"],
                       tuple(j + 1 for j in config["eagle_aux_hidden_state_layer_ids"]),
                       layer["rms_norm_eps"], layer["rope_theta"])
    if tuple(embedding.shape) != (shape.vocab_size, shape.hidden_size):
        raise DraftInputError(f"the draft in {str(path)!r} is for a target of vocabulary {shape.vocab_size} and width "
                              f"{shape.hidden_size}; this target's embedding is {tuple(embedding.shape)}")
    draft = Eagle3Draft(shape, embedding, weights["d2t"], weights["t2d"])
    draft.load_state_dict({**weights, "embed_tokens.weight": draft.embed_tokens.weight}, strict=True)
    return draft.eval()
