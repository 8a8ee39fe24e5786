"""``kdcache generate``: the teacher writes responses to a dataset's prompts and its targets along them are cached
while it writes (stage one, run once). Flags come from ``stages.precompute.GenerateOptions``: precompute's, plus
the sampling (``--max-new-tokens``, ``--temperature``, ``--top-p``, ``--sampling-top-k``, ``--stop``,
``--num-responses``) and ``--responses given`` to cache a dataset's own responses; a ``--config`` file sets them
flat or under ``generate:``.
"""

from __future__ import annotations

import argparse

from kdcache import stages
from kdcache.pipeline.cli.commands import Subcommands, print_summary
from kdcache.pipeline.config import from_args
from kdcache.stages.precompute.generation.options import GenerateOptions
from kdcache.storage import format_bytes


def register(subparsers: Subcommands) -> None:
    """Add ``generate`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "generate", options=GenerateOptions,
        help="sample the teacher's own responses and cache its targets along them as it writes",
        description="Sample responses from a causal teacher to a dataset's prompts (plain texts, or conversations "
                    "rendered with the chat template's generation prompt) and cache, while it generates, the "
                    "targets precompute would cache of the finished text. The cache trains like any other (the loss "
                    "mask covers the responses); OUT.generations.jsonl beside it holds the conversations for "
                    "plain SFT. "
                    "Rerun the same command to resume; a response depends only on (seed, prompt, number).")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML file of flag names setting any flag, the command line winning: flat, or under "
                             "a 'generate:' section")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Build and validate the options, then generate and cache; print the summary on rank 0. Returns 0."""
    options = from_args(GenerateOptions, args, section="generate")
    summary = stages.run_generate(options)
    fmt = stages.format_generate_estimate if options.engine.estimate else stages.format_summary
    print_summary(summary, getattr(args, "json", False), fmt)
    if getattr(args, "json", False):
        return 0
    if summary.get("generations"):
        print(f"generations: {summary['generations']}")
    if summary.get("removed"):  # --packing: the responses one a row, now in OUT's packed rows
        removed = summary["removed"]
        print(f"removed {removed['path']} ({format_bytes(removed['bytes'])}: the responses one a row, packed into "
              f"{summary['out']}; --keep-unpacked keeps it)")
    return 0
