"""What both stages read off a Hugging Face config: its block stacks, and the transformers class that builds it.

A model has one stack of blocks (decoder-only and encoder models; token stream ``""``) or two (encoder-decoder
models: ``encoder`` and ``decoder``). Stage one sizes the teacher's token streams with ``stack_depths``; stage
two sizes the student's, and ``kdcache init-student`` shrinks each stack. This is the one module that knows how
each family spells these facts, so every other one handles a stack list, whatever the architecture.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Protocol

import transformers

from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

# Config keys holding a stack's depth, BART/mBART spelling first, then T5's.
DEPTH_KEYS = {"": ("num_hidden_layers",), "encoder": ("encoder_layers", "num_layers"),
              "decoder": ("decoder_layers", "num_decoder_layers")}


class ArchitectureError(KdcacheError):
    """A config whose stacks cannot be read."""


class ModelClass(Protocol):
    """A transformers class a model is loaded with: a model class (``GPT2LMHeadModel``) or an Auto class.

    The result stays untyped: ``output_loading_info=True`` makes it a ``(model, info)`` pair.
    """

    def from_pretrained(self, name: str, /, *args: Any, **kwargs: Any) -> Any:
        """Load a checkpoint (a folder or a hub id)."""


def is_encoder_decoder(config: PretrainedConfig) -> bool:
    """Whether the model has separate encoder and decoder stacks (BART, mBART, T5...)."""
    return bool(getattr(config, "is_encoder_decoder", False))


def stack_depths(config: PretrainedConfig) -> dict[str, int]:
    """Blocks per stack: ``{"": N}``, or ``{"encoder": N_e, "decoder": N_d}`` (the decoder defaults to N_e).

    Raises:
        ArchitectureError: an encoder-decoder config whose encoder depth cannot be read.
    """
    if not is_encoder_decoder(config):
        return {"": int(config.num_hidden_layers)}
    data = config.to_dict()
    encoder = next((int(data[k]) for k in DEPTH_KEYS["encoder"] if data.get(k)), 0)
    decoder = next((int(data[k]) for k in DEPTH_KEYS["decoder"] if data.get(k)), encoder)
    if not encoder:
        raise ArchitectureError(f"cannot read the encoder/decoder depth of a {config.model_type} config")
    return {"encoder": encoder, "decoder": decoder}


def with_depths(config: PretrainedConfig, depths: dict[str, int]) -> PretrainedConfig:
    """A copy of ``config`` whose stacks have ``depths`` blocks (every key the config spells a depth with)."""
    config = copy.deepcopy(config)
    data = config.to_dict()
    for stack, depth in depths.items():
        # num_hidden_layers reaches GPT-2's n_layer through the config's attribute map, so it is set even when
        # to_dict() spells it otherwise.
        for key in [k for k in DEPTH_KEYS[stack] if k in data] or DEPTH_KEYS[stack][:1]:
            setattr(config, key, depth)
    return config


def stack_module(model: PreTrainedModel, stack: str) -> torch.nn.Module:
    """The module holding ``stack``'s blocks: the model itself for ``""``, else its encoder or decoder."""
    return {"": lambda: model, "encoder": model.get_encoder, "decoder": model.get_decoder}[stack]()


def model_class(config: PretrainedConfig) -> ModelClass:
    """The transformers class to build: the config's own architecture, else the family's LM, else the bare model."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if is_encoder_decoder(config):  # first: BART also has a *ForCausalLM (its decoder alone)
        return transformers.AutoModelForSeq2SeqLM
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM):
        if type(config) in auto._model_mapping:
            return auto
    return transformers.AutoModel


def lm_class(config: PretrainedConfig) -> ModelClass:
    """The class with the language-model head: for an encoder-decoder, ``AutoModelForSeq2SeqLM`` whatever the
    config's ``architectures`` say (bart-base's name its bare ``BartModel``, which has no head and cannot build
    decoder inputs from labels); else ``model_class``."""
    return transformers.AutoModelForSeq2SeqLM if is_encoder_decoder(config) else model_class(config)


def is_causal_config(config: PretrainedConfig) -> bool:
    """Whether a one-stack model attends causally: decoder-only LMs do; BERT-style encoders do not (unless
    configured as decoders); an encoder-decoder is not one stack (its decoder's masks are the model's own)."""
    return not is_encoder_decoder(config) and type(config) in transformers.AutoModelForCausalLM._model_mapping and (
        getattr(config, "is_decoder", False)
        or config.model_type not in ("bert", "roberta", "distilbert", "electra"))
