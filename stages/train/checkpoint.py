"""Checkpoints (DeepSpeed's, plus where the data stream stands) and the final export of the student.

Layout of a run directory::

    RUN/checkpoints/latest          DeepSpeed's pointer to the newest tag
    RUN/checkpoints/step{N}/        model + projectors + optimizer (sharded as ZeRO keeps them)
    RUN/student/                    the exported student: a plain HF model + the cache's tokenizer
    RUN/student/../projectors.pt    the projectors (and other loss modules), kept apart from the student

The data position (epoch, global sample index), the optimizer step and the micro-step travel in DeepSpeed's
``client_state``; resuming restores them with the weights, so a resumed run reads exactly the remaining samples.

A checkpoint fails cleanly: train states each one's size before it starts and refuses a destination that cannot
hold one (``check_room``); a save that fails on a full disk removes its partial tag and raises ``CheckpointError``
(exit 2), and ``latest`` moves only once a tag is complete, by an atomic rename (DeepSpeed's own ``latest`` is
rewritten in place, so a full disk could leave it empty), so the previous checkpoint stays the one resumed.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kdcache.storage import KdcacheError, format_bytes

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedModel

CHECKPOINT_DIR = "checkpoints"
STUDENT_DIR = "student"
PROJECTORS_FILE = "projectors.pt"
PLAN_FILE = "plan.json"


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a DeepSpeed checkpoint to resume from."""
    return (checkpoint_dir(run_dir) / "latest").is_file()


class CheckpointError(KdcacheError):
    """A checkpoint cannot be written: no room for one, or the disk filled up while writing it."""


ADAM_MOMENTS = 2  # fp32 tensors of optimizer state per trainable parameter (AdamW, the default optimizer)


def estimate_bytes(module: nn.Module, half_precision: bool) -> int:
    """What one checkpoint of ``module`` takes on disk, summed over ranks: every parameter in its dtype, an fp32
    master copy of each trainable one when training in bf16/fp16, and Adam's two fp32 moments. A 714 M student in
    bf16: 714 M x (2 + 4 + 8) B = 10.0 GB, as measured on the GPU."""
    total = 0
    for p in module.parameters():
        total += p.numel() * p.element_size()
        if p.requires_grad:
            total += p.numel() * 4 * (ADAM_MOMENTS + (1 if half_precision else 0))
    return total


def check_room(run_dir: str | Path, one: int, count: int) -> str:
    """A line stating the checkpoints' size and the free space; ``CheckpointError`` when not even one fits.

    Args:
        run_dir: the run directory (checkpoints go to ``RUN/checkpoints``).
        one: ``estimate_bytes`` of one checkpoint.
        count: checkpoints this run writes (DeepSpeed keeps them all).
    """
    free = shutil.disk_usage(_existing(checkpoint_dir(run_dir))).free
    line = (f"each checkpoint ~{format_bytes(one)} ({count} this run, ~{format_bytes(one * count)} in all); "
            f"{format_bytes(free)} free in {checkpoint_dir(run_dir)}")
    if free < one:
        raise CheckpointError(f"{checkpoint_dir(run_dir)} has {format_bytes(free)} free, and one checkpoint of this "
                              f"student needs ~{format_bytes(one)}; free space there or choose another --out")
    return line


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (where the free space is measured)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def save_checkpoint(engine: DeepSpeedEngine, run_dir: str | Path, *, step: int, micro_step: int,
                    data_state: dict[str, Any], extra: dict[str, Any] | None = None,
                    estimate: int = 0) -> Path:
    """Save model, projectors, optimizer, scheduler and the data position. Every rank must call it.

    Args:
        step: optimizer steps done (``micro_step``: micro-batches, grad-accum of them per step).
        micro_step: micro-batches consumed (seeds per-step dropout, see ``loop``).
        data_state: ``DataPosition.to_dict()`` plus the settings the order depends on.
        extra: more state kept beside it (the wgan critics, which live outside the engine).
        estimate: ``estimate_bytes`` of one checkpoint, for the message when the disk fills up.

    Raises:
        CheckpointError: the disk filled up; the partial tag is removed and ``latest`` still names the previous one.
    """
    root = checkpoint_dir(run_dir)
    tag = f"step{step}"
    client_state = {"kdcache": {"step": step, "micro_step": micro_step, "data": dict(data_state), **(extra or {})}}
    try:
        engine.save_checkpoint(str(root), tag=tag, client_state=client_state, save_latest=False)
        if engine.global_rank == 0:
            _point_latest(root, tag)
    except (OSError, RuntimeError) as exc:
        if not _disk_full(exc, root, estimate):
            raise
        raise _full_disk_error(root, tag, estimate, engine.global_rank == 0) from None
    _barrier()
    return root / tag


def _point_latest(root: Path, tag: str) -> None:
    """Write ``latest`` (DeepSpeed's pointer) by an atomic rename: it names the old tag or the new, never nothing."""
    scratch = root / "latest.tmp"
    with open(scratch, "w") as fh:
        fh.write(tag)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(scratch, root / "latest")


def _disk_full(exc: BaseException, root: Path, estimate: int) -> bool:
    """Whether a failed save ran out of disk: ENOSPC anywhere in its chain, or torch's zip writer failing with less
    room left than a checkpoint needs (it reports ``unexpected pos``, not the errno)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return shutil.disk_usage(_existing(root)).free < max(estimate, 1)


def _full_disk_error(root: Path, tag: str, estimate: int, main: bool) -> CheckpointError:
    """Remove the partial tag (it would only hold space) and say what is left to resume from."""
    latest = root / "latest"
    previous = latest.read_text().strip() if latest.is_file() else None
    if main and previous != tag:
        shutil.rmtree(root / tag, ignore_errors=True)
    need = f"; one checkpoint needs ~{format_bytes(estimate)}" if estimate else ""
    kept = (f"the previous checkpoint {previous} is intact: free space, then --resume" if previous
            else "no earlier checkpoint exists")
    return CheckpointError(f"the disk filled up while writing checkpoint {tag} in {root} "
                           f"({format_bytes(shutil.disk_usage(_existing(root)).free)} free{need}); {kept}")


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


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


def export_student(student: PreTrainedModel, projectors: nn.Module, run_dir: str | Path, *, rank: int,
                   zero_stage: int, tokenizer_dir: str | Path | None) -> Path:
    """Write the student as a plain HF model (``save_pretrained``) and the projectors beside it.

    Under ZeRO-3 each rank holds only a slice of every parameter, so the parameters are gathered first; this is
    collective, every rank must call it. Only rank 0 writes.

    Args:
        student: the HF student (inside the engine's module).
        projectors: the loss's projectors, saved to ``RUN/projectors.pt`` (``save_projectors``).
        tokenizer_dir: the cache's tokenizer folder, copied next to the student so it is usable on its own.

    Returns:
        ``RUN/student``.
    """
    out = Path(run_dir) / STUDENT_DIR
    modules = [student, projectors]
    with _gathered([p for m in modules for p in m.parameters()], zero_stage):
        if rank == 0:
            student.save_pretrained(str(out))
            save_projectors(run_dir, projectors)
    if rank == 0:
        add_tokenizer(out, tokenizer_dir)
    _barrier()  # no rank returns before the student is whole on disk
    return out


def add_tokenizer(student_dir: Path, tokenizer_dir: str | Path | None) -> None:
    """Copy the cache's tokenizer files next to a saved student, so that it is usable on its own."""
    if tokenizer_dir is None or not Path(tokenizer_dir).is_dir():
        return
    for item in Path(tokenizer_dir).iterdir():
        if item.is_file() and not (student_dir / item.name).exists():  # never overwrite the model's own files
            shutil.copy2(item, student_dir / item.name)


def _gathered(params: list[nn.Parameter], zero_stage: int) -> contextlib.AbstractContextManager:
    """Full parameters for the duration of the block: a no-op below ZeRO-3."""
    if zero_stage < 3:
        return contextlib.nullcontext()
    import deepspeed  # heavy, and ZeRO-3 only: CacheTrainer and eval import this module without it

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


class _Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...


def save_projectors(folder: str | Path, projectors: nn.Module, critics: _Stateful | None = None) -> Path:
    """Write ``folder/projectors.pt``, the one layout every road writes (``kdcache train``, ``CacheTrainer``, a loop's
    ``DistillationLoss.save_run``) and ``kdcache eval --run`` reads: ``{"projectors": state dict on the CPU}``
    (empty when the loss has none), plus ``"critics"`` (their ``state_dict()``) for a wgan loss.

    Returns:
        The file's path.
    """
    state: dict[str, Any] = {"projectors": {k: v.detach().cpu().clone() for k, v in projectors.state_dict().items()}}
    if critics is not None:
        state["critics"] = critics.state_dict()
    path = Path(folder) / PROJECTORS_FILE
    torch.save(state, path)
    return path


def read_projectors(folder: str | Path) -> dict[str, Any]:
    """``folder/projectors.pt`` as ``save_projectors`` wrote it, on the CPU: ``{"projectors": state dict}`` and, for a
    wgan loss, ``"critics"``; the one reader of that layout."""
    return dict(torch.load(Path(folder) / PROJECTORS_FILE, map_location="cpu"))


def write_plan(folder: str | Path, plan: dict[str, object]) -> None:
    """Write ``folder/plan.json`` (the layer maps ``kdcache eval --run`` scores with), as ``kdcache train`` does."""
    (Path(folder) / PLAN_FILE).write_text(json.dumps(plan, indent=2) + "\n")
