"""``kdcache init-student`` for encoder-decoder teachers: copy chosen encoder and decoder blocks.

The encoder and decoder stacks are shrunk independently (``--encoder-layers`` / ``--decoder-layers``, or
``--layers`` for both). Embeddings, final norms, the LM head and anything outside the two block lists are copied
as they are. Blocks are numbered 1..N per stack, as ``encoder_hidden_states`` / ``decoder_hidden_states``
number their outputs.

T5 keeps its relative-position bias in the *first* block of each stack only; a student whose first block is a
copy of teacher block 3 still needs that table, so it is taken from the teacher's first block.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kdcache.stages.train.student import StudentError, copy_tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Config keys holding each stack's depth: BART/mBART first, then T5.
ENCODER_DEPTH_KEYS = ("encoder_layers", "num_layers")
DECODER_DEPTH_KEYS = ("decoder_layers", "num_decoder_layers")


def stack_depths(config: Any) -> tuple[int, int]:
    """(encoder blocks, decoder blocks) of a BART/mBART or T5 config."""
    data = config.to_dict()
    encoder = next((int(data[k]) for k in ENCODER_DEPTH_KEYS if data.get(k)), 0)
    decoder = next((int(data[k]) for k in DECODER_DEPTH_KEYS if data.get(k)), encoder)
    if not encoder:
        raise StudentError(f"cannot read the encoder depth of a {config.model_type} config")
    return encoder, decoder


def stack_prefixes(model: PreTrainedModel) -> tuple[str, str]:
    """Names of the encoder's and decoder's block lists (``model.encoder.layers``, ``encoder.block``...)."""
    names = {id(m): name for name, m in model.named_modules()}
    found = []
    for side, depth in zip((model.get_encoder(), model.get_decoder()), stack_depths(model.config)):
        lists = [m for m in side.modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
        if not lists:
            raise StudentError(f"cannot find the {depth} blocks of {type(side).__name__}")
        found.append(names[id(lists[0])])  # modules() walks outer to inner: the block list comes first
    return found[0], found[1]


def _check(name: str, layers: list[int], depth: int) -> None:
    bad = [j for j in layers if not 1 <= j <= depth]
    if not layers or bad:
        raise StudentError(f"{name} {list(layers)} must be teacher blocks 1..{depth}"
                           + (f"; out of range: {bad}" if bad else "; none given"))


def _shrunk_config(config: Any, encoder: int, decoder: int) -> Any:
    config = copy.deepcopy(config)
    data = config.to_dict()
    for keys, depth in ((ENCODER_DEPTH_KEYS, encoder), (DECODER_DEPTH_KEYS, decoder)):
        for key in keys:
            if key in data:
                setattr(config, key, depth)
    return config


def _source_key(key: str, source: dict[str, Any], prefixes: tuple[str, str],
                blocks: tuple[list[int], list[int]]) -> str:
    """The teacher parameter that student parameter ``key`` copies."""
    for prefix, chosen in zip(prefixes, blocks):
        head = prefix + "."
        if key.startswith(head):
            index, _, rest = key[len(head):].partition(".")
            mapped = f"{head}{chosen[int(index)]}.{rest}"
            # A parameter only the first block has (T5's relative-position bias) comes from that block.
            return mapped if mapped in source else key
    return key


def copy_seq2seq_blocks(teacher: PreTrainedModel, encoder_blocks: list[int],
                        decoder_blocks: list[int]) -> PreTrainedModel:
    """A student whose encoder block i is teacher encoder block ``encoder_blocks[i]`` (0-based), same for the
    decoder; everything outside the two block lists is copied as is."""
    prefixes = stack_prefixes(teacher)
    config = _shrunk_config(teacher.config, len(encoder_blocks), len(decoder_blocks))
    student = type(teacher)(config)
    source = teacher.state_dict()
    state = {k: source[_source_key(k, source, prefixes, (encoder_blocks, decoder_blocks))]
             for k in student.state_dict()}
    student.load_state_dict(state, strict=True)
    return student


def init_seq2seq_student(teacher_path: str | Path, encoder_layers: list[int], decoder_layers: list[int],
                         out: str | Path) -> Path:
    """Build and save a seq2seq student made of the chosen teacher blocks (1-based, per stack).

    Raises:
        StudentError: empty or out-of-range layers, or blocks that cannot be found.
    """
    from transformers import AutoModelForSeq2SeqLM

    from kdcache.stages.train.student import load_config

    encoder_depth, decoder_depth = stack_depths(load_config(teacher_path))
    _check("encoder layers", encoder_layers, encoder_depth)
    _check("decoder layers", decoder_layers, decoder_depth)
    teacher = AutoModelForSeq2SeqLM.from_pretrained(str(teacher_path))
    student = copy_seq2seq_blocks(teacher, [j - 1 for j in encoder_layers], [j - 1 for j in decoder_layers])
    out = Path(out)
    student.save_pretrained(str(out))
    copy_tokenizer_files(Path(teacher_path), out)
    (out / "kdcache_init.json").write_text(json.dumps(
        {"teacher": str(teacher_path), "teacher_encoder_blocks": list(encoder_layers),
         "teacher_decoder_blocks": list(decoder_layers)}, indent=2) + "\n")
    return out
