"""``kdcache precompute`` and ``kdcache merge``: run stage one, and join a job array's parts.

Flags come from ``stages.precompute.core.options.PrecomputeOptions``, and from ``--config`` (its ``precompute:``
section, or a flat file) as ``pipeline.config`` reads it.
"""

from __future__ import annotations

import argparse

from kdcache import stages
from kdcache.pipeline.cli.commands import Subcommands, print_summary
from kdcache.pipeline.config import from_args
from kdcache.stages.precompute.core.options import PrecomputeOptions


def register(subparsers: Subcommands) -> None:
    """Add ``precompute`` and ``merge`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "precompute", options=PrecomputeOptions,
        help="run the teacher once and cache its hidden states, attention and logits",
        description="Run a Hugging Face teacher over a dataset and write the selected targets as compressed shards. "
                    "Rerun the same command to resume after a crash; run it under torchrun, or as a job array "
                    "with --num-shards/--shard-index, to scale out.")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file of flag names (dashes or underscores) setting any flag, the command line "
                             "winning: flat, or under a 'precompute:' section (a file with a 'train:' section too "
                             "serves `kdcache run`); an unknown key is refused")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)
    merge = subparsers.add_parser("merge", help="join the parts of a job-array precompute into one manifest")
    merge.add_argument("cache", metavar="CACHE", help="cache directory")
    merge.set_defaults(func=run_merge)


def run(args: argparse.Namespace) -> int:
    """Build and validate the options, then run stage one; print the summary on rank 0. Returns 0."""
    options = from_args(PrecomputeOptions, args, section="precompute")
    fmt = stages.format_estimate if options.engine.estimate else stages.format_summary
    print_summary(stages.run_precompute(options), getattr(args, "json", False), fmt)
    return 0


def run_merge(args: argparse.Namespace) -> int:
    """Merge a cache's committed parts; exit 0 when complete, 1 when shards are still missing."""
    result = stages.merge_cache(args.cache)
    print(f"{result['out']}: {result['status']}, {result['committed_shards']}/{result['num_shards']} shards, "
          f"{result['num_tokens']:,} tokens")
    return 0 if result["status"] == "complete" else 1
