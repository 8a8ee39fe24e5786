"""Checkpoints (DeepSpeed's, plus where the data stream stands) and the final export of the student.

Layout of a run directory::

    RUN/checkpoints/latest          DeepSpeed's pointer to the newest tag
    RUN/checkpoints/step{N}/        model + projectors + optimizer (sharded as ZeRO keeps them)
    RUN/student/                    the exported student: a plain HF model + the cache's tokenizer
    RUN/student/../projectors.pt    the projectors (and other loss modules), kept apart from the student

The data position (epoch, global sample index), the optimizer step and the micro-step travel in DeepSpeed's
``client_state``; resuming restores them with the weights, so a resumed run reads exactly the remaining samples.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedModel

CHECKPOINT_DIR = "checkpoints"
STUDENT_DIR = "student"
PROJECTORS_FILE = "projectors.pt"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a DeepSpeed checkpoint to resume from."""
    return (checkpoint_dir(run_dir) / "latest").is_file()


def save_checkpoint(engine: DeepSpeedEngine, run_dir: str | Path, *, step: int, micro_step: int,
                    data_state: dict[str, Any], extra: dict[str, Any] | None = None) -> Path:
    """Save model, projectors, optimizer, scheduler and the data position. Every rank must call it.

    Args:
        engine: the DeepSpeed engine.
        run_dir: the run directory.
        step: optimizer steps done.
        micro_step: micro-batches consumed (seeds per-step dropout, see ``loop``).
        data_state: ``DataPosition.to_dict()`` plus the settings the order depends on.
        extra: more state kept beside it (the wgan critics, which live outside the engine).
    """
    root = checkpoint_dir(run_dir)
    tag = f"step{step}"
    client_state = {"kdcache": {"step": step, "micro_step": micro_step, "data": dict(data_state), **(extra or {})}}
    engine.save_checkpoint(str(root), tag=tag, client_state=client_state)
    return root / tag


def load_latest(engine: DeepSpeedEngine,
 run_dir: str | Path) -> dict[str, Any] | None:
    """Load the newest checkpoint into ``engine``; returns our client state, or None when there is none."""
    if not has_checkpoint(run_dir):
        return None
    path, client_state = engine.load_checkpoint(str(checkpoint_dir(run_dir)), load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    if path is None:
        return None
    return (client_state or {}).get("kdcache")


def export_student(student: PreTrainedModel, extras: dict[str, nn.Module], run_dir: str | Path, *, rank: int,
                   zero_stage: int, tokenizer_dir: str | Path | None) -> Path:
    """Write the student as a plain HF model (``save_pretrained``) and the extras (projectors) beside it.

    Under ZeRO-3 each rank holds only a slice of every parameter, so the parameters are gathered first; this is
    collective, every rank must call it. Only rank 0 writes.

    Args:
        student: the HF student (inside the engine's module).
        extras: other trained modules (projectors, critic), saved to ``RUN/projectors.pt`` as state dicts.
        run_dir: the run directory.
        rank: this process's rank.
        zero_stage: the engine's ZeRO stage.
        tokenizer_dir: the cache's tokenizer folder, copied next to the student so it is usable on its own.

    Returns:
        ``RUN/student``.
    """
    out = Path(run_dir) / STUDENT_DIR
    modules = [student, *extras.values()]
    with _gathered([p for m in modules for p in m.parameters()], zero_stage):
        if rank == 0:
            student.save_pretrained(str(out))
            state = {name: {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}
                     for name, m in extras.items()}
            torch.save(state, Path(run_dir) / PROJECTORS_FILE)
    if rank == 0 and tokenizer_dir is not None and Path(tokenizer_dir).is_dir():
        for item in Path(tokenizer_dir).iterdir():
            if item.is_file() and not (out / item.name).exists():  # never overwrite the model's own files
                shutil.copy2(item, out / item.name)
    return out


def _gathered(params: list[nn.Parameter], zero_stage: int) -> contextlib.AbstractContextManager:
    """Full parameters for the duration of the block: a no-op below ZeRO-3."""
    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
