"""Fingerprints of the things cached targets depend on: tokenizers and model configs.

Both stages compute them the same way: stage one records them in the manifest, stage two recomputes them for
its student and compares (``storage.compare_fingerprints``). Hashes are storage's ``sha256:<hex>`` strings, made by
its ``StreamHash`` / ``hash_json``, so every fingerprint of a manifest reads the same way (mismatch messages shorten
them). What is left here reads models and tokenizers, which storage never does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kdcache.storage import StreamHash, hash_json

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """Vocabulary hash, size and special tokens of a HF tokenizer.

    Two tokenizers with the same fingerprint map every string to the same ids, which is what makes a teacher's
    cached logits meaningful to a student.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    specials = {name: str(tok) for name, tok in sorted(tokenizer.special_tokens_map.items())}
    return {
        "vocab_hash": hash_json(vocab),
        "vocab_size": len(tokenizer),
        "special_tokens": specials,
    }


def clear_call_state(tokenizer: PreTrainedTokenizerBase) -> None:
    """Drop the truncation and padding that an earlier call left on a fast tokenizer's backend.

    HF fast tokenizers keep the last call's ``truncation=``/``padding=`` in their backend, and its serialised
    pipeline and a saved ``tokenizer.json`` carry them; cleared, both are the same bytes whichever process (or rank)
    tokenized. Every call sets its own again, so this changes no ids.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend.no_truncation()
        backend.no_padding()


def config_fingerprint(config: PretrainedConfig) -> str:
    """Hash of a HF ``PretrainedConfig``, leaving out fields that do not change the outputs."""
    data = config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "torch_dtype", "dtype", "_attn_implementation",
                     "_attn_implementation_autoset", "output_attentions", "output_hidden_states"):
        data.pop(volatile, None)
    return hash_json(data)


def weights_fingerprint(model_dir: str | Path | None, state_dict: dict[str, Any] | None = None) -> str:
    """Hash of a model's weights.

    For a local folder this hashes the weight files' bytes (fast, and exact: same files, same targets). For a
    model without files (built in memory) it hashes the tensors of ``state_dict``.
    """
    h = StreamHash()
    root = Path(model_dir) if model_dir is not None else None
    files = sorted({p for pat in ("*.safetensors", "*.bin", "*.pt") for p in root.glob(pat)}) if root else []
    if files:
        for path in files:
            h.update(path.name.encode())
            with open(path, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 24), b""):
                    h.update(block)
        return h.hexdigest()
    if state_dict is None:
        raise ValueError(f"no weight files found in {model_dir!r} and no state_dict given")
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()

