"""What a speculative-decoding draft reads beside a cache's hidden layers, as both stage one and the draft see it.

An EAGLE-3 draft fuses three of the target's layers (low, middle, high) and reads the target's own input embedding
(frozen); its reduced vocabulary is the N most frequent tokens of the data. Stage one writes these with
``--layers draft`` into the cache's ``draft/`` folder, the way ``teacher_head/`` carries a head:
``inputs.safetensors`` (``embedding [V, d]`` in the target's dtype, ``token_counts [V]`` int64) and ``draft.json``
(the three layers, sizes, the target's maximum positions and architectures, and the sha256 of the weights file).
The target's next-token distribution is the cache's logits (``--logits head`` or top-k), not stored again here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load, save

from kdcache.stages.targets.draft.draft_layers import DRAFT_PRESET, draft_layers, is_draft_preset
from kdcache.storage import KdcacheError, canonical_json, folder_is_complete, hash_bytes, put_files, read_json

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.storage import Store

DRAFT_FOLDER = "draft"
def token_counts(sequences: Iterable[np.ndarray], vocab: int) -> np.ndarray:
    """``[V]`` int64: how often each token id occurs in ``sequences`` (each ``[L_i]`` ids)."""
    counts = np.zeros(vocab, dtype=np.int64)
    for ids in sequences:
        counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
    return counts


def target_embedding(model: PreTrainedModel) -> torch.Tensor:
    """The target's input embedding ``[V, d]`` (its token embedding table)."""
    weight = model.get_input_embeddings().weight
    assert isinstance(weight, torch.Tensor)
    return weight


def export_draft_inputs(model: PreTrainedModel, store: Store, layers: tuple[int, ...], counts: np.ndarray) -> None:
    """Write ``draft/`` (see the module docstring) into the cache's ``store``; kept if already complete."""
    if folder_is_complete(store, DRAFT_FOLDER):  # a resumed run, or another job of the array, wrote it already
        return
    embedding = target_embedding(model).detach().cpu().contiguous()
    data = save({"embedding": embedding, "token_counts": torch.from_numpy(counts.astype(np.int64))})
    vocab, width = embedding.shape
    info = {"layers": [int(j) for j in layers], "vocab_size": int(vocab), "hidden_size": int(width),
            "num_blocks": int(model.config.num_hidden_layers), "tokens_counted": int(counts.sum()),
            # for the export's config: the positions the target takes and its classes (speculators' verifier)
            "max_positions": int(getattr(model.config, "max_position_embeddings", 0) or 0),
            "architectures": list(getattr(model.config, "architectures", None) or []),
            "dtype": str(embedding.dtype).replace("torch.", ""), "sha256": hash_bytes(data)}
    put_files(store, DRAFT_FOLDER, {"inputs.safetensors": data, "draft.json": canonical_json(info)})


def read_draft_inputs(store: Store) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``draft/``'s tensors (``embedding [V, d]``, ``token_counts [V]``) and ``draft.json``, the hash checked.

    Raises:
        KdcacheError: no ``draft/`` (the cache was not written with ``--layers draft``), or damaged files.
    """
    if not folder_is_complete(store, DRAFT_FOLDER):
        raise KdcacheError("this cache has no draft/ folder (the target's embedding and token counts a draft reads); "
                           "write it with `kdcache precompute --layers draft` (with --logits head or topk)")
    info = read_json(store, f"{DRAFT_FOLDER}/draft.json", "the draft inputs' record")
    data = store.read(f"{DRAFT_FOLDER}/inputs.safetensors")
    if hash_bytes(data) != info.get("sha256"):
        raise KdcacheError(f"{DRAFT_FOLDER}/inputs.safetensors does not match the sha256 recorded in draft.json: "
                           f"the draft inputs are damaged or were replaced; rerun stage one")
    return load(data), info


__all__ = ["DRAFT_FOLDER", "DRAFT_PRESET", "draft_layers", "export_draft_inputs", "is_draft_preset",
           "read_draft_inputs", "target_embedding", "token_counts"]
