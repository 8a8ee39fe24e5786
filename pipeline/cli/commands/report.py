"""``kdcache report``: plots and one HTML page for a run or a sweep (finished or still running)."""

from __future__ import annotations

import argparse
from pathlib import Path

from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.config import ConfigError
from kdcache.pipeline.report import report_run, report_sweep


def register(subparsers: Subcommands) -> None:
    """Add ``report`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "report", help="PNG plots and an HTML page for a run or a sweep (works mid-run)",
        description="For a run: each loss term over the steps, the student x teacher CKA heatmap (when "
                    "an evaluation exists in RUN/evals/) and the cache's bytes per token per target. For a sweep: "
                    "the results table, a bar chart of one metric per grid point, every run's loss curve, and a report "
                    "per run. Everything lands in PATH/report/ (report.html embeds the plots).")
    parser.add_argument("path", metavar="RUN_OR_SWEEP", help="a run directory or a sweep directory")
    parser.add_argument("--out", metavar="DIR", help="where to write (default: PATH/report)")
    parser.add_argument("--metric", metavar="COLUMN",
                        help="sweep bar chart metric, a results column such as eval_spearman, eval_perplexity, "
                             "eval_cka_final or loss (default: the first eval metric present, else loss)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the report and print where it is. Returns 0."""
    path = Path(args.path)
    if (path / "sweep.json").is_file() or (path / "runs").is_dir():
        html = report_sweep(path, args.out, metric=args.metric)
    elif any((path / name).exists() for name in ("metrics.jsonl", "options.json", "plan.json")):
        html = report_run(path, args.out)
    else:
        raise ConfigError([f"{str(path)!r} is neither a run (metrics.jsonl, options.json) nor a sweep "
                           "(sweep.json, runs/)"])
    print(f"report written to {html} (PNG plots beside it)")
    return 0
