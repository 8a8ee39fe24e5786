"""The copy of a teacher's LM head that a ``--logits head`` cache carries, as both stages see its files.

Stage one writes it (``export_head``); stage two loads it (``load_teacher_head``) to compute exact teacher logits
from the cached last hidden layer, without loading anything else of the teacher. Files, in the cache's
``teacher_head/``: ``head.safetensors`` (``weight [V, d]`` in the teacher's dtype, ``bias [V]`` if any) and
``head.json`` (``layer`` N whose cached states the head reads, sizes, ``logit_scale`` / ``softcap`` and the sha256
of the weights file).

Nothing per token is stored for logits; the cache holds the teacher's last hidden layer N (after its final norm,
as HF numbers it). ``TeacherHead`` applies the copied head to the cached states of the valid tokens only, in the
head's own dtype like the teacher did, giving ``[N_v, V]`` logits at any temperature. The head's weights are
buffers, not parameters: nothing trains them and checkpoints leave them out.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from safetensors.torch import load, save
from torch import nn

from kdcache.storage import KdcacheError, canonical_json, folder_is_complete, hash_bytes, put_folder, read_json

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from kdcache.storage import Store

HEAD_FOLDER = "teacher_head"


def finish_logits(logits: torch.Tensor, scale: float | None, softcap: float | None) -> torch.Tensor:
    """The head's output as the model's logits: times ``logit_scale`` (Cohere), then soft-capped (Gemma), in that
    order; stage one's chunked head and stage two's copy both apply this, so their logits agree."""
    if scale:
        logits = logits * scale
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def export_head(model: PreTrainedModel, store: Store, layer: int) -> None:
    """Save a copy of the teacher's LM head (see the module docstring) into the cache's ``store`` (it appears
    whole)."""
    if folder_is_complete(store, HEAD_FOLDER):  # a resumed run, or another job of the array, wrote it already
        return
    head = model.get_output_embeddings()
    tensors = {"weight": head.weight.detach().cpu().contiguous()}
    if getattr(head, "bias", None) is not None:
        tensors["bias"] = head.bias.detach().cpu().contiguous()
    data = save(tensors)
    vocab, width = tensors["weight"].shape
    info = {"layer": layer, "vocab_size": int(vocab), "hidden_size": int(width),
            "dtype": str(tensors["weight"].dtype).replace("torch.", ""),
            "parameters": sum(t.numel() for t in tensors.values()),
            "logit_scale": getattr(model.config, "logit_scale", None) or None,
            "softcap": getattr(model.config, "final_logit_softcapping", None) or None,
            "sha256": hash_bytes(data)}
    with tempfile.TemporaryDirectory(prefix="kdcache-head-") as tmp:
        (Path(tmp) / "head.safetensors").write_bytes(data)
        (Path(tmp) / "head.json").write_bytes(canonical_json(info))
        put_folder(store, HEAD_FOLDER, Path(tmp))  # listed with its checksums, so verify checks the copy


class TeacherHead(nn.Module):
    """``forward(hidden [N, d]) -> logits [N, V]`` float32.

    Args:
        tensors: ``weight [V, d]`` and optionally ``bias [V]``.
        info: ``head.json`` (``layer``, ``logit_scale``, ``softcap``...).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, tensors: dict[str, torch.Tensor], info: dict[str, Any]):
        super().__init__()
        self.register_buffer("weight", tensors["weight"], persistent=False)
        self.register_buffer("bias", tensors.get("bias"), persistent=False)
        self.layer = int(info["layer"])
        self.scale, self.softcap = info.get("logit_scale"), info.get("softcap")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias).float()
        return finish_logits(logits, self.scale, self.softcap)

    def describe(self) -> str:
        """Its size, for the start of a training log."""
        kept = [t for t in (self.weight, self.bias) if t is not None]
        count = sum(int(t.numel()) for t in kept)
        mib = sum(int(t.numel()) * t.element_size() for t in kept) / 2**20
        return (f"teacher head from the cache: {count / 1e6:.1f}M parameters, {mib:,.1f} MiB "
                f"({str(self.weight.dtype).replace('torch.', '')}), applied to cached layer {self.layer}")


def load_teacher_head(store: Store, hidden_layers: tuple[int, ...] | None = None) -> TeacherHead:
    """The head of a ``--logits head`` cache (its weights checked against the sha256 in ``head.json``; that record is
    not hashed, so the layer it names is checked against the cache's deepest ``hidden_layers``, the one stage two
    streams for it).

    Raises:
        KdcacheError: the files are missing or cannot be read, the weights are damaged, or the head reads another
            layer.
    """
    info = read_json(store, f"{HEAD_FOLDER}/head.json", "the teacher head's record (written with --logits head)")
    try:
        data = store.read(f"{HEAD_FOLDER}/head.safetensors")
    except OSError as exc:
        raise KdcacheError(f"this cache was written with --logits head but its {HEAD_FOLDER}/ cannot be read "
                           f"({exc}); rerun stage one") from None
    if hash_bytes(data) != info.get("sha256"):
        raise KdcacheError(f"{HEAD_FOLDER}/head.safetensors does not match the sha256 recorded in head.json: the "
                           f"teacher head is damaged or was replaced; rerun stage one")
    head = TeacherHead(load(data), info)
    if hidden_layers is not None and head.layer != max(hidden_layers, default=-1):
        raise KdcacheError(f"the cache's teacher_head/ reads layer {head.layer}, but its last cached hidden layer is "
                           f"{max(hidden_layers, default=None)}; rerun stage one")
    return head
