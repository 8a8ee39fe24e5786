"""Sweeps: one training per grid point, all from the same cache, one after another.

Each run is its own child process (``python -m kdcache train ...``, or the user's launcher prefix such as
``torchrun --nproc_per_node 8``): DeepSpeed's process group, its compiled ops and the allocator's memory do not
leak from one run into the next, and a crash — even a segfault or an OOM kill — ends one grid point, not the
sweep. The teacher is never touched: every run reads the cache.

Layout of a sweep directory::

    SWEEP/sweep.json                 the grid, the base options, one record per run (rewritten after each run)
    SWEEP/results.csv, results.md    the comparison table (grid values, status, final loss terms, eval metrics)
    SWEEP/runs/<name>/               an ordinary run directory, plus train.log, eval.log and sweep-run.json

Rerunning the same sweep into the same folder reuses finished runs and resumes interrupted ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdcache.pipeline.children import child_env
from kdcache.pipeline.config import ConfigError, build, flags, option_names
from kdcache.pipeline.report import collect_rows, write_tables
from kdcache.stages.common.option_groups import flatten, leaves
from kdcache.stages.common.stream_options import flag_name
from kdcache.stages.train.core.options import TrainOptions
from kdcache.stages.train.evaluation.eval_records import find_eval, remove_evals
from kdcache.storage import read_json_object

# Keys a grid may not vary: the sweep owns `out`, and "one cache" is the point of a sweep.
RESERVED_KEYS = ("out", "cache", "resume", "config")
RUN_RECORD = "sweep-run.json"


@dataclass
class SweepPoint:
    """One grid point: its run name, its grid values (as given) and its validated options."""

    name: str
    values: dict[str, str]
    options: TrainOptions


@dataclass
class SweepSettings:
    """How to run the points: launcher prefix, held-out eval cache, eval batch size."""

    launcher: list[str] = field(default_factory=lambda: [sys.executable])
    eval_cache: str | None = None
    eval_batch_size: int = 16
    eval_limit: int | None = None


# ---- the grid ----------------------------------------------------------------------------------------------
def split_values(text: str) -> list[str]:
    """Split a grid value list on commas, keeping ``explicit:`` layer maps whole.

    ``"uniform,explicit:1-2,2-4,none"`` gives ``["uniform", "explicit:1-2,2-4", "none"]``: a bare ``S-T`` pair
    continues the explicit map before it. A JSON list (``'["a", "b"]'``) is taken as is.
    """
    text = text.strip()
    if text.startswith("["):
        try:
            return [str(v) for v in json.loads(text)]
        except json.JSONDecodeError:
            pass
    values: list[str] = []
    for item in (p.strip() for p in text.split(",")):
        if values and re.fullmatch(r"\d+-\d+", item) and values[-1].startswith("explicit:"):
            values[-1] += "," + item
        elif item:
            values.append(item)
    return values


def parse_grid(items: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """Parse ``--grid key=v1,v2`` items into an ordered ``{field: values}``.

    Returns:
        (grid, problems): every malformed item, unknown or reserved key and repeated key is a problem.
    """
    fields = option_names(TrainOptions)  # with the aliases: decoder_layer_map=...
    grid: dict[str, list[str]] = {}
    problems: list[str] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        values = split_values(raw)
        if not sep or not key or not values:
            problems.append(f"--grid {item!r}: expected KEY=V1,V2,... (e.g. layer_map=uniform,reverse)")
        elif key not in fields:
            problems.append(f"--grid {item!r}: {key!r} is not a train option; known: {', '.join(sorted(fields))}")
        elif key in RESERVED_KEYS:
            problems.append(f"--grid {item!r}: {key!r} cannot vary within a sweep (the sweep sets it)")
        elif key in grid:
            problems.append(f"--grid {item!r}: {key!r} is given twice; list all its values in one --grid")
        else:
            grid[key] = values
    return grid, problems


def run_name(values: dict[str, str]) -> str:
    """A folder name from grid values: ``{"layer_map": "explicit:1-2,2-4"}`` -> ``layer_map-explicit_1-2_2-4``."""
    parts = [f"{key}-{re.sub(r'[^A-Za-z0-9.+-]+', '_', str(value)).strip('_')}" for key, value in values.items()]
    return "__".join(parts) or "base"


def plan_sweep(base: dict[str, Any], grid: dict[str, list[str]], sweep_dir: str | Path) -> list[SweepPoint]:
    """Expand the grid (cartesian product, in the order given) and validate every point's options.

    Args:
        base: train options shared by every point (``--cache``, ``--student``, other train flags, YAML).
        grid: ``{field: values}`` from ``parse_grid``.
        sweep_dir: the sweep folder; run ``name`` trains into ``sweep_dir/runs/name``.

    Raises:
        ConfigError: every problem of every point, each once, naming the points it concerns.
    """
    found: dict[str, list[str]] = {}
    points: list[SweepPoint] = []
    names: set[str] = set()
    for combo in itertools.product(*grid.values()) if grid else [()]:
        values = dict(zip(grid, combo))
        name, i = run_name(values), 2
        while name in names:  # two points whose values read alike: NAME-2, NAME-3...
            name, i = f"{run_name(values)}-{i}", i + 1
        names.add(name)
        out = str(Path(sweep_dir) / "runs" / name)
        try:
            points.append(SweepPoint(name, values, build(TrainOptions, {**base, **values, "out": out})))
        except ConfigError as exc:
            for problem in exc.problems:
                found.setdefault(problem, []).append(name)
    if found:
        total = len(points) + len({n for ns in found.values() for n in ns})
        raise ConfigError([p if len(ns) == total else f"{p} (grid point(s): {', '.join(ns)})"
                           for p, ns in found.items()])
    return points


def conflicts(points: list[SweepPoint], launcher: list[str]) -> list[str]:
    """Run folders left by an earlier sweep with other options: refused up front, not after an hour of runs."""
    problems = []
    for point in points:
        run_dir = Path(point.options.run.out)
        previous = read_json_object(run_dir / RUN_RECORD).get("command")
        if previous and not same_run(previous, train_command(point.options, launcher)) and (
                run_dir / "checkpoints" / "latest").is_file():
            problems.append(f"{run_dir} holds a run trained with other options (see its {RUN_RECORD}); use "
                            "another --out, or delete that folder")
    return problems


def same_run(previous: list[str] | None, command: list[str]) -> bool:
    """Whether a recorded child command trains what ``command`` trains: the same launcher and the same options,
    whatever the order or spelling of their flags (an earlier kdcache wrote them in another order, maps as typed)."""
    if not previous or previous == command:
        return previous == command
    if "train" not in previous or previous[:previous.index("train")] != command[:command.index("train")]:
        return False
    try:
        return _options_of(previous) == _options_of(command)
    except (ConfigError, SystemExit, argparse.ArgumentError):
        return False


def _options_of(command: list[str]) -> dict[str, object]:
    """The train options a child command line sets (``--resume`` aside), as ``RUN/options.json`` holds them."""
    parser = argparse.ArgumentParser(parents=[flags(TrainOptions)], add_help=False, exit_on_error=False,
                                     allow_abbrev=False)
    known, _ = parser.parse_known_args([a for a in command[command.index("train") + 1:] if a != "--resume"])
    return build(TrainOptions, vars(known)).to_dict()


# ---- one run -----------------------------------------------------------------------------------------------
def train_flags(options: TrainOptions) -> list[str]:
    """The ``kdcache train`` flags reproducing ``options``: required fields, and every field off its default."""
    flags: list[str] = []
    values = flatten(options)
    for _, _, f in leaves(TrainOptions):
        value = values[f.name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name == "config" or (not required and value == f.default):
            continue  # the YAML's values are already merged into the options
        flag = flag_name(f.name)
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            flags += [flag, "none" if value is None else text]
    return flags


def train_command(options: TrainOptions, launcher: list[str], *, resume: bool = False) -> list[str]:
    """The child command line: the launcher prefix, the module, and the run's flags."""
    # The deepspeed launcher takes `--module NAME`, and would append --local_rank=N, which `kdcache train`
    # does not take (it reads LOCAL_RANK from the environment); python and torchrun take `-m NAME`.
    module = ["-m", "kdcache"]
    if Path(launcher[0]).name == "deepspeed":
        module = [*(["--no_local_rank"] if "--no_local_rank" not in launcher else []), "--module", "kdcache"]
    return [*launcher, *module, "train", *train_flags(options), *(["--resume"] if resume else [])]


def run_child(command: list[str], log_path: Path) -> tuple[int, float]:
    """Run ``command`` with its output in ``log_path``. Returns (exit status, wall seconds)."""
    env = child_env()
    start = time.perf_counter()
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return code, time.perf_counter() - start


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log (progress-bar carriage returns folded away)."""
    if not path.is_file():
        return ""
    text = path.read_text(errors="replace").replace("\r", "\n")
    return "\n".join([ln for ln in text.splitlines() if ln.strip()][-lines:])


def run_point(point: SweepPoint, settings: SweepSettings) -> dict[str, Any]:
    """Train one grid point (reusing or resuming what an earlier sweep left), then evaluate it.

    Returns:
        The run's record: name, values, command, status ("ok" | "reused" | "failed"), exit code, seconds,
        and for a failure the tail of its log.
    """
    run_dir = Path(point.options.run.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"name": point.name, "values": point.values, "run_dir": str(run_dir)}
    command = train_command(point.options, settings.launcher)
    previous = read_json_object(run_dir / RUN_RECORD)
    if previous.get("status") in ("ok", "reused") and same_run(previous.get("command"), command):
        record.update(previous, status="reused")
    else:
        # Recorded before the child starts, so a report drawn mid-sweep knows this run's grid values.
        _write_json(run_dir / RUN_RECORD, {**record, "command": command, "status": "running"})
        record.update(_train(point, settings, command))
    _write_json(run_dir / RUN_RECORD, record)
    evaluated = settings.eval_cache is not None and find_eval(run_dir, "trained", settings.eval_cache) is not None
    if record["status"] != "failed" and settings.eval_cache and not (record["status"] == "reused" and evaluated):
        record.update(_evaluate(run_dir, settings))
        _write_json(run_dir / RUN_RECORD, record)
    return record


def _train(point: SweepPoint, settings: SweepSettings, command: list[str]) -> dict[str, Any]:
    """Train (resuming a checkpoint: ``conflicts`` refused, before the sweep began, one left with other options)."""
    run_dir = Path(point.options.run.out)
    has_checkpoint = (run_dir / "checkpoints" / "latest").is_file()
    launched = train_command(point.options, settings.launcher, resume=has_checkpoint)
    code, seconds = run_child(launched, run_dir / "train.log")
    ok = code == 0 and (not point.options.run.export or (run_dir / "student").is_dir())
    result = {"command": command, "status": "ok" if ok else "failed", "returncode": code,
              "seconds": round(seconds, 1), "resumed": has_checkpoint}
    if not ok:
        result["log_tail"] = log_tail(run_dir / "train.log")
    return result


def _evaluate(run_dir: Path, settings: SweepSettings) -> dict[str, Any]:
    """``kdcache eval`` in its own process (the same isolation as training); writes RUN/evals/trained@...json."""
    command = [sys.executable, "-m", "kdcache", "eval", "--cache", str(settings.eval_cache), "--run",
               str(run_dir), "--batch-size", str(settings.eval_batch_size)]
    if settings.eval_limit:
        command += ["--limit", str(settings.eval_limit)]
    remove_evals(run_dir, "trained", str(settings.eval_cache))  # a failed eval must not show the old model's
    code, seconds = run_child(command, run_dir / "eval.log")
    if code != 0 or find_eval(run_dir, "trained", settings.eval_cache) is None:
        return {"eval_status": "failed", "eval_log_tail": log_tail(run_dir / "eval.log")}
    return {"eval_status": "ok", "eval_seconds": round(seconds, 1)}


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)  # a report reading mid-sweep never sees half a file


# ---- the whole sweep ---------------------------------------------------------------------------------------
def run_sweep(points: list[SweepPoint], sweep_dir: str | Path, settings: SweepSettings,
              grid: dict[str, list[str]], *, echo: Callable[..., None] = print) -> dict[str, Any]:
    """Run every point in order; a failed point is recorded and the sweep goes on.

    Returns:
        The sweep summary (also ``SWEEP/sweep.json``), with ``rows``: the comparison table.
    """
    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"grid": grid, "cache": points[0].options.data.cache, "eval_cache": settings.eval_cache,
                               "launcher": settings.launcher, "runs": []}
    for i, point in enumerate(points, 1):
        echo(f"[{i}/{len(points)}] {point.name}: training", flush=True)
        record = run_point(point, settings)
        summary["runs"].append(record)
        _write_json(root / "sweep.json", summary)
        echo(f"[{i}/{len(points)}] {point.name}: {_outcome(record)}", flush=True)
    summary["rows"] = collect_rows(root, summary)
    write_tables(root, summary["rows"], list(grid))
    _write_json(root / "sweep.json", summary)
    return summary


def _outcome(record: dict[str, Any]) -> str:
    if record["status"] == "failed":
        last = (record.get("log_tail") or record.get("error") or "").splitlines()[-1:] or ["no log"]
        return f"FAILED (exit {record.get('returncode')}): {last[0]}"
    text = f"{record['status']} ({record.get('seconds', 0):.0f} s)"
    if record.get("eval_status"):
        text += f", eval {record['eval_status']}"
    return text
