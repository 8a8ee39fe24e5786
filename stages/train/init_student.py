"""``kdcache init-student``: a shallower student made of copies of chosen teacher blocks.

Copying weights beats random init by a wide margin (seed 002, Table 1). This is a separate step that loads the
teacher's files once, before training; the training code never imports this module, so a training run cannot
load the teacher by accident.

Blocks are numbered as HF ``hidden_states`` numbers their outputs: block j (1..N) produces hidden state j.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from kdcache.stages.train.student import StudentError, copy_tokenizer_files, load_config, model_class

if TYPE_CHECKING:
    from transformers import PreTrainedModel

def init_student_from_teacher(teacher_path: str | Path, layers: list[int] | tuple[int, ...],
                              out: str | Path, *, encoder_layers: list[int] | None = None,
                              decoder_layers: list[int] | None = None) -> Path:
    """Build and save a student whose block i is a copy of teacher block ``layers[i]``.

    Embeddings, final norms and heads are copied too; the config is the teacher's with fewer layers.

    Args:
        teacher_path: a HF model folder.
        layers: teacher block numbers, 1-based, strictly increasing is usual but not required.
        out: folder to write the student (and the teacher's tokenizer files) into.
        encoder_layers, decoder_layers: for an encoder-decoder teacher, each stack's blocks (default
            ``layers``); see ``stages.train.init_seq2seq``.

    Returns:
        ``out``.

    Raises:
        StudentError: empty or out-of-range layers, or a model whose blocks cannot be found.
    """
    config = load_config(teacher_path)
    if getattr(config, "is_encoder_decoder", False):
        from kdcache.stages.train.init_seq2seq import init_seq2seq_student

        return init_seq2seq_student(teacher_path, list(encoder_layers or layers), list(decoder_layers or layers),
                                    out)
    depth = int(config.num_hidden_layers)
    bad = [j for j in layers if not 1 <= j <= depth]
    if not layers or bad:
        raise StudentError(f"layers {list(layers)} must be teacher blocks 1..{depth}" +
                           (f"; out of range: {bad}" if bad else "; none given"))
    teacher = model_class(config).from_pretrained(str(teacher_path))
    student = _shallow_copy(teacher, [j - 1 for j in layers])
    out = Path(out)
    student.save_pretrained(str(out))
    copy_tokenizer_files(Path(teacher_path), out)
    (out / "kdcache_init.json").write_text(json.dumps(
        {"teacher": str(teacher_path), "teacher_blocks": list(layers)}, indent=2) + "\n")
    return out


def _shallow_copy(teacher: PreTrainedModel, blocks: list[int]) -> PreTrainedModel:
    """A model of ``len(blocks)`` layers whose block i holds teacher block ``blocks[i]`` (0-based)."""
    prefix = block_list_prefix(teacher)
    config = copy.deepcopy(teacher.config)
    config.num_hidden_layers = len(blocks)
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer settings (e.g. sliding windows)
        config.layer_types = [config.layer_types[b] for b in blocks]
    student = type(teacher)(config)
    source = teacher.state_dict()
    state = {key: source[_teacher_key(key, prefix, blocks)] for key in student.state_dict()}
    student.load_state_dict(state, strict=True)
    return student


def block_list_prefix(model: PreTrainedModel) -> str:
    """Name of the ``nn.ModuleList`` holding the transformer blocks (``transformer.h``, ``model.layers``...)."""
    depth = int(model.config.num_hidden_layers)
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == depth]
    if not found:
        raise StudentError(f"cannot find the {depth} blocks of {type(model).__name__} (no ModuleList of that size)")
    return min(found, key=len)  # the outermost list of blocks, not a list inside a block


def _teacher_key(key: str, prefix: str, blocks: list[int]) -> str:
    """Map a student parameter name to the teacher's: block i becomes block ``blocks[i]``."""
    head = prefix + "."
    if not key.startswith(head):
        return key
    index, _, rest = key[len(head):].partition(".")
    return f"{head}{blocks[int(index)]}.{rest}"


__all__ = ["init_student_from_teacher", "block_list_prefix"]
