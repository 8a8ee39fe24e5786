"""A run's options are its identity: what ``--resume`` may change, and where ``--init-from`` starts a new run.

``RUN/options.json`` is the record of what trained the student. A resumed run must train on under that record,
so ``--resume`` refuses any change to a loss, map, data, student or engine option and names each one; only the
options that cannot change what the student learns may differ (how long it runs, what it logs, when it saves,
how many threads read the cache). To change a loss mid-way, ``--init-from RUN`` starts a new run from RUN's
exported student (and its projectors, where their shapes still fit), and the new run's ``plan.json`` says so.

Paths are labels here: the cache is compared by the hash of its fingerprints (``plan.json``'s ``cache_hash``), so
a moved or copied cache resumes; a run written before that hash was recorded compares the cache's path.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from torch import nn

from kdcache.stages.common.option_groups import leaves
from kdcache.stages.common.stream_options import flag_name
from kdcache.stages.train.checkpoint import PROJECTORS_FILE, read_projectors
from kdcache.stages.train.core.options import TrainOptions
from kdcache.storage import KdcacheError, hash_json, read_json_object

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
    if before == after:
        return True
    return name in PATH_OPTIONS and isinstance(before, str) and isinstance(after, str) and \
        Path(before).resolve() == Path(after).resolve()


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
