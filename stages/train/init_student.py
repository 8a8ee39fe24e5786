"""``kdcache init-student``: a shallower student made of copies of chosen teacher blocks.

Copying weights beats random init by a wide margin (seed 002, Table 1). This is a separate step that loads the
teacher's files once, before training; the training code never imports this module, so a training run cannot
load the teacher by accident.

Blocks are numbered as HF ``hidden_states`` numbers their outputs: block j (1..N) produces hidden state j. Every
stack of the teacher (one, or an encoder and a decoder, ``stages.common.architectures``) is shrunk the same way,
each to its own block list. Embeddings, final norms, heads and anything outside the block lists are copied as
they are. T5 keeps its relative-position bias in the *first* block of each stack only; a student whose first
block copies teacher block 3 still needs that table, so it comes from the teacher's first block.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from kdcache.stages.common.architectures import lm_class, stack_depths, stack_module, with_depths
from kdcache.stages.train.core.student import StudentError, copy_tokenizer_files, load_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def init_student_from_teacher(teacher_path: str | Path, layers: list[int] | tuple[int, ...],
                              out: str | Path, *, encoder_layers: list[int] | None = None,
                              decoder_layers: list[int] | None = None) -> Path:
    """Build and save a student whose block i is a copy of teacher block ``layers[i]``, per stack.

    Args:
        teacher_path: a HF model folder.
        layers: teacher block numbers, 1-based, strictly increasing is usual but not required.
        out: folder to write the student (and the teacher's tokenizer files) into.
        encoder_layers, decoder_layers: for an encoder-decoder teacher, each stack's blocks (default ``layers``).

    Returns:
        ``out``.

    Raises:
        StudentError: empty or out-of-range layers, a model whose blocks cannot be found, or an ``out`` that is not
            a new or empty folder.
    """
    out = Path(out)
    check_out(out)
    config = load_config(teacher_path)
    given = {"": layers, "encoder": encoder_layers or layers, "decoder": decoder_layers or layers}
    chosen = {stack: list(given[stack]) for stack in stack_depths(config)}
    for stack, depth in stack_depths(config).items():
        _check(stack, chosen[stack], depth)
    teacher = lm_class(config).from_pretrained(str(teacher_path))
    student = copy_blocks(teacher, {stack: [j - 1 for j in blocks] for stack, blocks in chosen.items()})
    student.save_pretrained(str(out))
    copy_tokenizer_files(Path(teacher_path), out)
    record = {f"teacher_{stack}_blocks" if stack else "teacher_blocks": blocks for stack, blocks in chosen.items()}
    (out / "kdcache_init.json").write_text(json.dumps({"teacher": str(teacher_path), **record}, indent=2) + "\n")
    return out


def check_out(out: Path) -> None:
    """Refuse an ``out`` that is not a new or empty folder: a student is never written into a cache, over another
    student or among a user's files (the rule precompute and train follow for their own folders).

    Raises:
        StudentError: naming the folder and what it holds.
    """
    if out.exists() and not out.is_dir():
        raise StudentError(f"--out {str(out)!r} is a file; choose a new or empty folder for the student")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if "kdcache_init.json" in held:
        what = "already holds a student built by init-student; choose a new folder, or delete this one to rebuild it"
    elif "manifest.json" in held:
        what = "is a kdcache cache; choose a new or empty folder for the student"
    else:
        what = f"is not empty (found {', '.join(held[:5])}); choose a new or empty folder for the student"
    raise StudentError(f"--out {str(out)!r} {what}")


def _check(stack: str, layers: list[int], depth: int) -> None:
    bad = [j for j in layers if not 1 <= j <= depth]
    if not layers or bad:
        name = f"{stack} layers" if stack else "layers"
        raise StudentError(f"{name} {layers} must be teacher blocks 1..{depth}"
                           + (f"; out of range: {bad}" if bad else "; none given"))


def copy_blocks(teacher: PreTrainedModel, blocks: dict[str, list[int]]) -> PreTrainedModel:
    """A model whose block i of each stack holds the teacher's block ``blocks[stack][i]`` (0-based)."""
    prefixes = {stack: block_list_prefix(teacher, stack) for stack in blocks}
    config = with_depths(teacher.config, {stack: len(chosen) for stack, chosen in blocks.items()})
    # Per-layer settings (sliding windows, say) follow their blocks.
    if "" in blocks and isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = [config.layer_types[b] for b in blocks[""]]
    student = type(teacher)(config)
    source = teacher.state_dict()
    state = {key: source[_source_key(key, source, prefixes, blocks)] for key in student.state_dict()}
    student.load_state_dict(state, strict=True)
    return student


def block_list_prefix(model: PreTrainedModel, stack: str = "") -> str:
    """Name of the ``nn.ModuleList`` holding ``stack``'s blocks (``transformer.h``, ``model.encoder.layers``...)."""
    depth = stack_depths(model.config)[stack]
    inside = {id(m) for m in stack_module(model, stack).modules()}
    found = [name for name, m in model.named_modules()
             if id(m) in inside and isinstance(m, nn.ModuleList) and len(m) == depth]
    if not found:
        raise StudentError(f"cannot find the {depth} blocks of {type(model).__name__} (no ModuleList of that size)")
    return min(found, key=len)  # the outermost list of blocks, not a list inside a block


def _source_key(key: str, source: dict[str, Any], prefixes: dict[str, str], blocks: dict[str, list[int]]) -> str:
    """The teacher parameter that student parameter ``key`` copies: block i of a stack becomes its chosen block."""
    for stack, prefix in prefixes.items():
        head = prefix + "."
        if key.startswith(head):
            index, _, rest = key[len(head):].partition(".")
            mapped = f"{head}{blocks[stack][int(index)]}.{rest}"
            # A parameter only the first block has (T5's relative-position bias) comes from that block.
            return mapped if mapped in source else key
    return key


__all__ = ["init_student_from_teacher", "block_list_prefix", "copy_blocks"]
