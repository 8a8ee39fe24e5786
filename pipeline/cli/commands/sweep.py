"""``kdcache sweep``: train one student per grid point from a single cache, then tabulate the results.

Every ``kdcache train`` flag is accepted and shared by all points; ``--grid KEY=V1,V2`` (repeatable) names the
options to vary. The grid is validated against ``TrainOptions`` before any run starts: an unknown key or a bad
value ends the command with exit status 2 and every problem listed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from kdcache import stages, storage
from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.config import ConfigError, given_values
from kdcache.pipeline.sweep import SweepSettings, conflicts, parse_grid, plan_sweep, run_sweep, train_command
from kdcache.stages.train.core.options import TrainOptions


def register(subparsers: Subcommands) -> None:
    """Add ``sweep`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "sweep", options=TrainOptions, skip=("out", "resume", *SWEEP_EVAL),
        help="train one student per grid point, all from one cache, and compare them",
        description="Run `kdcache train` once per point of the cartesian product of the --grid options, one "
                    "run after another, each in its own process and its own SWEEP/runs/<name>/ folder. The "
                    "teacher is never loaded. A failed run is recorded and the sweep goes on. Writes "
                    "SWEEP/results.csv and results.md (grid values, status, final loss terms, eval metrics). "
                    "Rerunning the same command reuses finished runs and resumes interrupted ones.")
    parser.add_argument("--out", dest="sweep_out", required=True, metavar="SWEEP", help="the sweep folder")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="a train option and its values, e.g. layer_map=uniform,reverse or gamma=0.1,1 "
                             "(repeatable; explicit:1-2,2-4 maps stay whole)")
    parser.add_argument("--eval-cache", metavar="HELDOUT", help="evaluate each finished run against this cache")
    parser.add_argument("--eval-batch-size", type=int, default=16, metavar="N", help="eval batch size")
    parser.add_argument("--eval-limit", type=int, metavar="N", help="evaluate on the first N sequences only")
    parser.add_argument("--launcher", metavar="CMD", default=None,
                        help='prefix that starts each run instead of this python, e.g. "torchrun '
                             '--nproc_per_node 8" or "deepspeed --num_gpus 8"')
    parser.add_argument("--dry-run", action="store_true", help="print each run's command and stop")
    parser.set_defaults(func=run)


# The sweep's own --eval-cache scores each finished run (`kdcache eval`); train's held-out scoring stays off in it.
SWEEP_EVAL = ("eval_cache", "eval_every")


def base_values(args: argparse.Namespace) -> dict[str, Any]:
    """The train options shared by every point: the YAML's ``train:`` section, then the flags given."""
    values, problems = given_values(TrainOptions, args, "train", skip=("out", "resume", *SWEEP_EVAL))
    if problems:
        raise ConfigError(problems)
    values.pop("out", None)
    return values


def run(args: argparse.Namespace) -> int:
    """Validate the whole grid, then run it. Returns 0 when every run succeeded, 1 when any failed."""
    grid, problems = parse_grid(args.grid)
    if not grid and not problems:
        problems.append("no --grid given; name at least one option to vary, e.g. --grid layer_map=uniform,reverse")
    if args.eval_cache and not storage.cache_exists(args.eval_cache):
        problems.append(f"--eval-cache {args.eval_cache!r} is not a finished cache (no manifest.json)")
    try:
        points = plan_sweep(base_values(args), grid, args.sweep_out)
    except ConfigError as exc:
        problems += exc.problems
        points = []
    if points and args.eval_cache and storage.cache_exists(args.eval_cache):
        # a grid may vary the student, and whether it keeps the teacher's tokenizer
        for student, cross in dict.fromkeys((p.options.run.student, bool(p.options.loss.cross_tokenizer))
                                            for p in points):
            problems += _eval_cache_problems(args.eval_cache, student, cross)
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    problems += conflicts(points, launcher) if not problems else []
    if problems:
        raise ConfigError(problems)
    settings = SweepSettings(launcher=launcher, eval_cache=args.eval_cache, eval_batch_size=args.eval_batch_size,
                             eval_limit=args.eval_limit)
    if args.dry_run:
        for point in points:
            print(f"{point.name}: {shlex.join(train_command(point.options, launcher))}")
        return 0
    summary = run_sweep(points, args.sweep_out, settings, grid)
    print((Path(args.sweep_out) / "results.md").read_text())
    failed = [r["name"] for r in summary["runs"] if r["status"] == "failed"]
    print(f"{len(points) - len(failed)} of {len(points)} run(s) succeeded; table in {args.sweep_out}/results.csv"
          + (f"; failed: {', '.join(failed)} (logs in runs/<name>/train.log)" if failed else ""))
    return 1 if failed else 0


def _eval_cache_problems(eval_cache: str, student: str, cross: bool) -> list[str]:
    """Every run's student keeps the vocabulary and tokenizer of ``student``: one that does not fit the eval cache
    is refused before the first run, with the sentences `kdcache eval` and `kdcache train` use. A
    ``--cross-tokenizer`` run is scored span by span instead: its eval cache needs recorded texts."""
    reader = stages.open_cache(eval_cache)
    found = stages.text_problems(reader, "span agreement") if cross else stages.student_folder_problems(reader, student)
    return [f"--eval-cache {eval_cache!r}: {p}" for p in found]
