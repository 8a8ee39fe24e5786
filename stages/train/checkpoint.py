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

A run's options are its identity. ``RUN/options.json`` is the record of what trained the student, so ``--resume``
refuses any change to a loss, map, data, student or engine option and names each one; only the options that
cannot change what the student learns may differ (how long it runs, what it logs, when it saves, how many threads
read the cache). To change a loss mid-way, ``--init-from RUN`` starts a new run from RUN's exported student (and its
projectors, where their shapes still fit), and the new run's ``plan.json`` says so. Paths are labels here: the cache
is compared by the hash of its fingerprints (``plan.json``'s ``cache_hash``), so a moved or copied cache resumes; a
run written before that hash was recorded compares the cache's path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kdcache.stages.common.option_groups import leaves
from kdcache.stages.common.stream_options import flag_name
from kdcache.stages.train.core.options import TrainOptions
from kdcache.storage import KdcacheError, format_bytes, hash_json, read_json_object

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers import PreTrainedModel

CHECKPOINT_DIR = "checkpoints"
STUDENT_DIR = "student"
PROJECTORS_FILE = "projectors.pt"
PLAN_FILE = "plan.json"


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds a DeepSpeed checkpoint to resume from."""
    return (Path(run_dir) / CHECKPOINT_DIR / "latest").is_file()


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
    root = Path(run_dir) / CHECKPOINT_DIR
    free = shutil.disk_usage(_existing(root)).free
    line = (f"each checkpoint ~{format_bytes(one)} ({count} this run, ~{format_bytes(one * count)} in all); "
            f"{format_bytes(free)} free in {root}")
    if free < one:
        raise CheckpointError(f"{root} has {format_bytes(free)} free, and one checkpoint of this "
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
    root = Path(run_dir) / CHECKPOINT_DIR
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


def load_latest(engine: DeepSpeedEngine, run_dir: str | Path) -> dict[str, Any] | None:
    """Load the newest checkpoint into ``engine``; returns our client state. Callers refuse a resume without a
    checkpoint first (``has_checkpoint``, with kdcache's message): DeepSpeed itself would only log one and return
    None (this returns None then too)."""
    path, client_state = engine.load_checkpoint(str(Path(run_dir) / CHECKPOINT_DIR), load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
    return None if path is None else (client_state or {}).get("kdcache")


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
    gathered: contextlib.AbstractContextManager = contextlib.nullcontext()  # a no-op below ZeRO-3
    if zero_stage >= 3:
        import deepspeed  # heavy, and ZeRO-3 only: CacheTrainer and eval import this module without it

        gathered = deepspeed.zero.GatheredParameters([*student.parameters(), *projectors.parameters()],
                                                     modifier_rank=None)
    with gathered:
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


# Options that cannot change the result: the run's length, its logging, its checkpoints' interval, how the cache
# is read (threads, workers, read-ahead: the same samples arrive in the same order), what held-out cache scores it
# and how often (scoring never steps the optimizer), and where the run's folder is.
FREE_ON_RESUME = frozenset({"resume", "config", "out", "epochs", "max_steps", "log_every", "report_to", "quiet",
                            "save_every", "trace_samples", "export", "num_workers", "prefetch", "prefetch_mib",
                            "decode_threads", "eval_cache", "eval_every"})
PATH_OPTIONS = frozenset({"student", "deepspeed", "init_from", "cache"})  # the same file however the path is written
CACHE_HASH = "cache_hash"  # plan.json: hash_json of the cache's fingerprints
INIT_FROM = "init_from"  # plan.json: the run this one started from


class RunChangedError(KdcacheError):
    """``--resume`` with options that would change what the run trains."""


def cache_hash(fingerprints: dict[str, Any]) -> str:
    """The cache's identity for a run's record: the hash of its fingerprints (teacher, tokenizer, data, settings)."""
    return hash_json(dict(fingerprints))


def check_resume(run_dir: str | Path, options: TrainOptions, fingerprints: dict[str, Any]) -> None:
    """Refuse to resume ``run_dir`` with ``options`` (resolved, as ``options.json`` holds them) that differ from
    the run's record in anything but ``FREE_ON_RESUME``; reads the run folder, writes nothing.

    Raises:
        RunChangedError: naming each changed option, its recorded and its new value.
    """
    root = Path(run_dir)
    recorded = read_json_object(root / "options.json")
    if not recorded:
        return  # a checkpoint without a record (written by hand or by the API): nothing to hold it to
    now = json.loads(json.dumps(options.to_dict()))  # tuples as lists, as the record holds them
    changes = [_change(name, recorded[name], now.get(name)) for name in sorted(recorded)
               if name not in FREE_ON_RESUME and name != "cache" and name in now
               and not _same(name, recorded[name], now[name])]
    changes += _new_options(recorded, now)
    changes += cache_change(root, recorded, options.data.cache, fingerprints)
    refuse_changes(run_dir, changes, FREE_ON_RESUME - {"resume", "config", "out"},
                   f"To train on with the new options, start a new run from this one's student: --init-from "
                   f"{run_dir} --out NEW_RUN")


def refuse_changes(run_dir: object, changes: list[str], free: set[str] | frozenset[str], advice: str) -> None:
    """Raise ``RunChangedError`` listing ``changes`` (one line each) when there are any: a resumed run (``kdcache
    train`` or ``kdcache draft``) trains on under its record, and only the ``free`` options may change."""
    if not changes:
        return
    lines = "\n".join(f"  {c}" for c in changes)
    allowed = ", ".join(flag_name(n) for n in sorted(free))
    raise RunChangedError(
        f"--resume: {run_dir} was trained with other options, and a resumed run trains on under its record "
        f"(options.json); {len(changes)} changed:\n{lines}\nOnly options that cannot change the result may "
        f"change on --resume ({allowed}). {advice} (nothing in {run_dir} was changed)")


def _same(name: str, before: object, after: object) -> bool:
    """Equal values; a path option (``PATH_OPTIONS``) also when both name the same file from another folder."""
    return before == after or (name in PATH_OPTIONS and isinstance(before, str) and isinstance(after, str)
                               and Path(before).resolve() == Path(after).resolve())


def _change(name: str, before: object, after: object) -> str:
    return f"{flag_name(name)}: {json.dumps(before)} in the run, {json.dumps(after)} now"


def _new_options(recorded: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Options the record predates: a run written before an option existed trained at its default."""
    defaults = {f.name: f.default for _, _, f in leaves(TrainOptions) if f.default is not dataclasses.MISSING}
    return [_change(name, defaults.get(name), value) for name, value in sorted(now.items())
            if name not in recorded and name in defaults and name not in FREE_ON_RESUME and value != defaults[name]]


def cache_change(root: Path, recorded: dict[str, Any], cache: str, fingerprints: dict[str, Any]) -> list[str]:
    """The cache compared by its content (the fingerprints' hash in plan.json), by its path in an older record."""
    before = read_json_object(root / "plan.json").get(CACHE_HASH)
    if before is not None:
        now = cache_hash(fingerprints)
        return [] if before == now else [f"--cache: another cache ({cache}: fingerprints {now[7:19]}.., the run "
                                         f"read {before[7:19]}..)"]
    same = _same("cache", str(recorded.get("cache")), str(cache))
    return [] if same else [_change("cache", recorded.get("cache"), cache)]


def init_record(init_from: str | None) -> dict[str, Any]:
    """``plan.json``'s note of the run this one started from: its folder, its student and the steps it had
    trained; empty for a run that started from ``--student`` alone."""
    if not init_from:
        return {}
    root = Path(init_from).resolve()
    metrics = (root / "metrics.jsonl")
    last = metrics.read_text().splitlines()[-1:] if metrics.is_file() else []
    try:
        steps = int(json.loads(last[0])["step"]) if last else None
    except (ValueError, KeyError, TypeError):
        steps = None
    return {INIT_FROM: {"run": str(root), "student": str(root / "student"), "steps": steps,
                        "options": read_json_object(root / "options.json")}}


def start_projectors(model: nn.Module, init_from: str | None) -> str | None:
    """Load the projectors ``init_from``'s run exported into ``model.criterion.projectors`` where a pair's name
    and shape still fit (a new map or loss may pair other layers: those start fresh); a line saying how many."""
    target = getattr(getattr(model, "criterion", None), "projectors", None)
    source = Path(init_from or "") / PROJECTORS_FILE
    if not init_from or target is None or not source.is_file():
        return None
    saved = read_projectors(source.parent).get("projectors") or {}
    own = target.state_dict()
    fitting = {k: v for k, v in saved.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    target.load_state_dict(fitting, strict=False)
    return (f"--init-from {init_from}: student from {Path(init_from) / 'student'}; {len(fitting)} of {len(own)} "
            f"projector tensors from its {PROJECTORS_FILE} (the rest start fresh)")


def trained_on(run_dir: str | Path, cache: str, fingerprints: dict[str, Any]) -> bool:
    """Whether the run in ``run_dir`` trained on ``cache``: the same fingerprints' hash as its ``plan.json``
    records, or, for a run recorded before that hash, the same path."""
    root = Path(run_dir)
    return not cache_change(root, read_json_object(root / "options.json"), cache, fingerprints)
