"""``kdcache demo``: distil the real all-MiniLM-L6-v2 into a small student on the CPU and print a report."""

from __future__ import annotations

import argparse

from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.config import from_args
from kdcache.pipeline.demo import DemoOptions, format_report, run_demo, teacher_path


def register(subparsers: Subcommands) -> None:
    """Add ``demo`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "demo", options=DemoOptions,
        help="the built-in end-to-end demo on real MiniLM-L6 weights (no downloads, a few CPU minutes)",
        description="Cache all-MiniLM-L6-v2's hidden layers and attention maps over English sentences from "
                    "Python's docstrings, train a 3-block student from the cache under DeepSpeed ZeRO-2 on the "
                    "CPU, and report cache size, precompute time, the loss curve, peak memory and the "
                    "student's agreement with the teacher on held-out sentences. Run again into the same --out, it "
                    "reuses the caches, the student-init and the trained run made with the same settings and "
                    "prints the same figures; `make demo-clean` (or deleting --out) starts over.")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report. Returns 0."""
    options = from_args(DemoOptions, args)
    if options.print_teacher:  # `--teacher "$(kdcache demo --print-teacher)"` in the README's walkthrough
        print(teacher_path())
        return 0
    report = run_demo(options)
    print()
    print(format_report(report))
    return 0
