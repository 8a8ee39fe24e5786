"""``kdcache draft`` and ``kdcache draft-eval``: a speculative-decoding draft from the same cache, and its judge.

``draft`` trains an EAGLE-3 head from a cache written with ``--layers draft`` (no target loaded) under DeepSpeed and
exports it as speculators / vLLM load it; ``draft-eval`` runs speculative decoding with the target on held-out
prompts. Bad values exit 2 with the value and what was expected (``DraftInputError`` is a ``KdcacheError``).
"""

from __future__ import annotations

import argparse

from kdcache import stages  # a lazy door: torch loads when a draft command runs, not for --help
from kdcache.pipeline.cli.commands import Subcommands, print_summary


def register(subparsers: Subcommands) -> None:
    """Add ``draft`` and ``draft-eval`` to the ``kdcache`` subcommands."""
    train = subparsers.add_parser(
        "draft", help="train an EAGLE-3 speculative-decoding draft from a cache (written with --layers draft)",
        description="Train an EAGLE-3 draft head (fc over three target layers, one decoder layer, a reduced "
                    "vocabulary head) from a cache, the target never loaded, under DeepSpeed; export it in the "
                    "layout speculators and vLLM load.")
    train.add_argument("--cache", required=True, help="a cache written with `kdcache precompute --layers draft`")
    train.add_argument("--out", required=True, help="the run's folder: the exported draft, its checkpoints and "
                                                    "options.json (must not hold a draft already, unless --resume)")
    train.add_argument("--ttt-steps", type=int, default=3, metavar="K",
                       help="training-time test: steps the draft is fed its own outputs (default 3)")
    train.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                       help="the draft's vocabulary: the N most frequent tokens of the cache, 1..V (default "
                            "32000, or V if smaller)")
    for flag, kind, default, text in (("--max-steps", int, 200, "optimiser steps"),
                                      ("--batch-size", int, 8, "sequences per step"),
                                      ("--lr", float, 1e-3, "learning rate"), ("--seed", int, 0, "seed"),
                                      ("--heads", int, 0, "attention heads (0: head size 64 or 8)"),
                                      ("--save-every", int, 0, "checkpoint every N steps (0: only at the end)")):
        train.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    train.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in --out with the run's own options: only "
                            "--max-steps, --save-every and --layout may change (another option or cache is refused)")
    train.add_argument("--layout", choices=("speculators", "sglang"), default="speculators",
                       help="the export's layout: speculators' (vLLM loads it) or SGLang's EAGLE-3 checkpoint "
                            "(midlayer.* names) (default speculators)")
    train.add_argument("--json", action="store_true", help="print the summary as JSON")
    train.set_defaults(func=run_draft)
    judge = subparsers.add_parser(
        "draft-eval", help="speculative decoding with the target: acceptance length and speed-up per draft",
        description="Generate from held-out prompts with the target, drafted by prompt lookup, the KD student "
                    "(--student) and an EAGLE-3 head (--draft): acceptance length tau, per-position acceptance "
                    "and wall-clock speed-up over the target alone.")
    judge.add_argument("--target", required=True, help="the target model folder")
    judge.add_argument("--prompts", required=True, help="a text file, one held-out prompt per line")
    judge.add_argument("--draft", help="an EAGLE-3 draft exported by `kdcache draft`")
    judge.add_argument("--student", help="a student model folder to use as the draft (same tokenizer)")
    judge.add_argument("-k", type=int, default=4, help="draft tokens per round (default 4)")
    for flag, kind, default, text in (("--max-new", int, 32, "new tokens per prompt"),
                                      ("--temperature", float, 0.0, "0: greedy; else sampled at it"),
                                      ("--prompt-tokens", int, 64, "a prompt's tokens kept"),
                                      ("--limit", int, 0, "prompts used (0: all)"), ("--seed", int, 0, "seed"),
                                      ("--repeats", int, 1, "timed runs, alternating with the target alone; best "
                                                            "of each")):
        judge.add_argument(flag, type=kind, default=default, help=f"{text} (default {default})")
    judge.add_argument("--device", default="auto", help="where the target and the drafts run: auto (cuda when "
                                                        "there is one, else cpu), cpu, cuda, cuda:1... (default auto)")
    judge.add_argument("--json", action="store_true", help="print the report as JSON")
    judge.set_defaults(func=run_draft_eval)


def run_draft(args: argparse.Namespace) -> int:
    """Check the values, train (or resume) and export; prints the summary. Returns 0."""
    options = stages.DraftOptions(args.cache, args.out, args.ttt_steps, args.draft_vocab, args.max_steps,
                                  args.batch_size, args.lr, args.seed, args.heads, layout=args.layout,
                                  save_every=args.save_every, resume=args.resume)
    print_summary(stages.run_draft(options), args.json, _train_lines)
    return 0


def _train_lines(summary: dict[str, object]) -> str:
    resumed = "" if summary.get("resumed_from") is None else f" (resumed at step {summary['resumed_from']})"
    return (f"trained the draft {summary['steps']} steps{resumed}: loss {summary['first_loss']:.4f} -> "
            f"{summary['last_loss']:.4f}, step-0 agreement {summary['last_accuracy']:.2f}\n"
            f"draft       {summary['out']} (config.json, model.safetensors: {summary['layout']}'s EAGLE-3 layout)")


def run_draft_eval(args: argparse.Namespace) -> int:
    """Run the evaluation and print its report. Returns 0."""
    options = stages.EvalOptions(args.target, args.prompts, args.draft, args.student, args.k, args.max_new,
                                 args.temperature, args.prompt_tokens, args.limit, args.seed, args.repeats,
                                 args.device)
    print_summary(stages.evaluate_drafts(options), args.json, stages.format_report)
    return 0
