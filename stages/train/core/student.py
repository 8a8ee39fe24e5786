"""The student: loaded from a folder of weights, or built at random from a config.

Training imports this module, so it never touches a teacher; building a student *from* a teacher's blocks is
``stages.train.init_student`` (a separate command, run before training).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoTokenizer

from kdcache.stages.common.architectures import is_causal_config, is_encoder_decoder, model_class, stack_depths
from kdcache.stages.common.fingerprints import tokenizer_fingerprint
from kdcache.stages.targets.attention.attention_maps import MAPS_ATTENTION, register_maps_attention
from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT model's save_pretrained writes its adapters with this config
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


class StudentError(KdcacheError):
    """The student path holds neither a loadable model nor a config."""


@dataclass(frozen=True)
class StudentFacts:
    """What the checks and the loss need to know about a student."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int
    has_lm_head: bool
    is_causal: bool
    decoder_layers: int = 0  # encoder-decoder students: the decoder's depth (num_layers is the encoder's)
    is_encoder_decoder: bool = False
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as num_heads
    head_dim: int = 0  # width of one head; 0: hidden_size / num_heads

    def attention_widths(self) -> tuple[int, int]:
        """Widths of a token's queries (``H x head_dim``) and of its keys and values (``H_kv x head_dim``)."""
        head_dim = self.head_dim or (self.hidden_size // self.num_heads if self.num_heads else 0)
        return self.num_heads * head_dim, (self.num_kv_heads or self.num_heads) * head_dim


def has_weights(path: str | Path) -> bool:
    """Whether ``path`` is a folder holding model weights (not just a config)."""
    root = Path(path)
    return root.is_dir() and any(next(root.glob(p), None) for p in WEIGHT_PATTERNS)


def load_config(path: str | Path) -> PretrainedConfig:
    """The HF config of a student given as a folder or as a ``config.json`` file.

    Raises:
        StudentError: nothing loadable is there.
    """
    root = Path(path)
    try:
        if root.is_file():
            data = json.loads(root.read_text())
            model_type = data.pop("model_type", None)
            if model_type is None:
                raise StudentError(f"{root} has no 'model_type'; it is not a HF config.json")
            return AutoConfig.for_model(model_type, **data)
        return AutoConfig.from_pretrained(str(root))
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        raise StudentError(f"cannot read a model config from {str(root)!r}: {exc}") from None


def load_student(path: str | Path, *, seed: int = 0,
                 attn_implementation: str | None = None) -> PreTrainedModel:
    """Load pretrained weights when ``path`` has them, else build a random model from its config.

    Args:
        path: a HF model folder, a folder with only ``config.json``, or a ``config.json`` file.
        seed: seeds the random init (the same seed gives the same student on every rank).
        attn_implementation: ``attention_maps.MAPS_ATTENTION`` when attention maps are needed (SDPA kernels return
            none; plain "eager" returns them after dropout).

    Returns:
        A model with an LM head when its architecture has one (``*ForCausalLM``, ``*ForMaskedLM``, ...),
        else the bare encoder.
    """
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if attn_implementation == MAPS_ATTENTION:  # before either way of loading: from_pretrained checks the name
        register_maps_attention()
    if (Path(path) / ADAPTER_CONFIG).is_file() and not (Path(path) / "config.json").is_file():
        return adapted_student(Path(path), **kwargs)
    config = load_config(path)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    cls = model_class(config)
    if has_weights(path):
        return cls.from_pretrained(str(path), config=config, **kwargs)
    torch.manual_seed(seed)
    # An Auto class builds with from_config, a model class with _from_config (which ModelClass leaves out).
    return cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)  # type: ignore[attr-defined]


def adapted_student(folder: Path, **kwargs: Any) -> PreTrainedModel:
    """A PEFT adapter folder (``CacheTrainer.save_model`` of a LoRA student): the base model its ``adapter_config.json``
    names, with the adapters loaded into it by transformers (which needs peft: ``pip install 'kdcache[peft]'``), so
    that it runs as the trained student did; ``kwargs``: ``from_pretrained``'s (the attention implementation).

    Raises:
        StudentError: the adapter config names no base model.
    """
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise StudentError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path; expected the adapters of a "
                           "PEFT model saved with save_pretrained")
    return model_class(load_config(base)).from_pretrained(str(folder), **kwargs)


def student_facts(model: PreTrainedModel) -> StudentFacts:
    """Read the student's shape from its config (and whether it produces logits)."""
    cfg = model.config
    two_stacks = is_encoder_decoder(cfg)
    heads = getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0)
    return StudentFacts(
        num_layers=int(cfg.num_hidden_layers), hidden_size=int(cfg.hidden_size), num_heads=int(heads),
        vocab_size=int(cfg.vocab_size), has_lm_head=model.get_output_embeddings() is not None,
        is_causal=is_causal_config(cfg),
        decoder_layers=stack_depths(cfg)["decoder"] if two_stacks else 0, is_encoder_decoder=two_stacks,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or 0),
        head_dim=int(getattr(cfg, "head_dim", None) or 0))


def tokenizer_fingerprint_of(path: str | Path) -> dict[str, Any] | None:
    """The student's tokenizer fingerprint when its folder holds a tokenizer, else None."""
    root = Path(path)
    if not root.is_dir() or not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                      "vocab.txt", "vocab.json")):
        return None
    try:
        return tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(root)))
    except (OSError, ValueError):
        return None


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute activations in backward; non-reentrant, which works with ZeRO-3's parameter hooks."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise StudentError(f"{type(model).__name__} does not support gradient checkpointing")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False  # a KV cache and recomputation do not mix


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def copy_tokenizer_files(src: Path, out: Path) -> None:
    """Copy the tokenizer files of model folder ``src`` that exist into ``out`` (students share the teacher's)."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
