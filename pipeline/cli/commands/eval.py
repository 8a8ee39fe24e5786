"""``kdcache eval``: measure a trained student against a (held-out) cache, without the teacher."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdcache import stages, storage
from kdcache.pipeline.cli.commands import Subcommands
from kdcache.pipeline.config import ConfigError

if TYPE_CHECKING:
    from kdcache.storage import CacheReader


def register(subparsers: Subcommands) -> None:
    """Add ``eval`` to the ``kdcache`` subcommands."""
    parser = subparsers.add_parser(
        "eval", help="evaluate a student against a cache (teacher-free); writes RUN/evals/{role}@{cache}.json",
        description="Causal LMs: perplexity on the cached input_ids and, when the cache has logits, top-1 "
                    "agreement with the teacher and KL(teacher || student) per valid token. Encoders: mean "
                    "cosine of the final states and Spearman of the pairwise sentence similarities. Every run: "
                    "linear CKA of "
                    "every student layer against every cached teacher layer, and its values on the run's layer "
                    "map. The student comes from RUN/student (role 'trained'), or from --student (role "
                    "'baseline', e.g. the initial student before training); the teacher's targets come from the "
                    "cache only. Each (role, cache) pair has its own file, naming the cache, its fingerprint "
                    "and the sequences and tokens scored, so evaluations of one run never overwrite each other. "
                    "A --cross-tokenizer run (RUN/options.json says so) is scored span by span on a cache with "
                    "recorded texts (--record-text): span top-1 (the teacher's and the student's next text agree), "
                    "span cosine and CKA of span-pooled hidden states on the run's layer map (the uniform map when "
                    "it has none), and the aligned share; its tokens are the teacher's.")
    parser.add_argument("--cache", required=True, metavar="CACHE", help="the cache to evaluate against")
    parser.add_argument("--run", required=True, metavar="RUN",
                        help="the run directory: its student is scored (unless --student) and the result is kept "
                             "in RUN/evals/")
    parser.add_argument("--student", default=None, metavar="PATH",
                        help="score this student instead, as the run's baseline: a model folder, or a config.json "
                             "folder (random init, seed 0); the run need not be trained yet")
    parser.add_argument("--batch-size", type=int, default=16, metavar="N", help="sequences per forward pass")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N sequences")
    parser.add_argument("--teacher-layer", type=int, default=None, metavar="J",
                        help="teacher layer for the final-state comparison (default: the deepest cached)")
    parser.add_argument("--device", default="cpu", help="where the student runs (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--cross-tokenizer", action="store_true",
                        help="score span agreement even where RUN/options.json does not name --cross-tokenizer "
                             "(a baseline with its own tokenizer, scored before the run trains)")
    parser.add_argument("--json", action="store_true", help="print the evaluation as JSON instead of a summary")
    parser.set_defaults(func=run)


def score_notes(eval_cache: CacheReader, run_dir: Path, cache: str) -> list[str]:
    """A warning when the eval cache's teacher differs from the one the run was trained against, and a note when
    the cache scored is the one the run trained on: its scores are not held-out scores."""
    notes = []
    train_cache = storage.read_json_object(run_dir / "options.json").get("cache")
    if train_cache and storage.cache_exists(train_cache):
        trained = (storage.CacheReader(train_cache, allow_partial=True).fingerprints or {}).get("teacher") or {}
        wanted = {"teacher": {k: trained.get(k) for k in ("config_hash", "weights_hash")}}
        found = storage.compare_fingerprints({"teacher": (eval_cache.fingerprints or {}).get("teacher") or {}}, wanted)
        notes = [f"the eval cache's teacher differs from the training cache's: {p}" for p in found]
    if stages.trained_on(run_dir, cache, eval_cache.fingerprints or {}):
        notes.append(f"{cache} is the cache this run trained on: these scores are on its training data, not on "
                     "held-out data; score a cache of other text (precompute it with the same settings) to see how "
                     "the student generalises")
    return notes


def check_baseline(out: Path, student: str) -> None:
    """Refuse (EvaluationError) to replace a run's baseline on this cache with another student's: the report
    compares the trained student with it, and a second ``--student`` would silently change what "before" means
    (the same student again re-scores it)."""
    held = storage.read_json_object(out) if out.is_file() else None
    if held and held.get("role") == "baseline" and held.get("student") not in (None, student):
        raise stages.EvaluationError(f"{out} already holds this run's baseline on that cache, from the student "
                                     f"{held['student']!r}; to score {student!r} as the baseline instead, delete "
                                     f"that file first")


def run(args: argparse.Namespace) -> int:
    """Evaluate, write RUN/evals/{role}@{cache label}.json, print a summary. Returns 0."""
    bad = [f"--{flag} {value}: expected a whole number >= 1" for flag, value in
           (("batch-size", args.batch_size), ("limit", args.limit)) if value is not None and value < 1]
    if bad:
        raise ConfigError(bad)
    reader = stages.open_cache(args.cache)
    run_dir = Path(args.run)
    path = stages.cache_identity(args.cache)
    label = stages.cache_label(path, reader.fingerprints or {})
    role = "baseline" if args.student else "trained"
    student = str(Path(args.student).resolve()) if args.student else str(stages.trained_student(run_dir))
    out = stages.eval_path(run_dir, role, label)
    check_baseline(out, student)
    if args.cross_tokenizer or stages.is_cross_run(run_dir):
        result = stages.evaluate_cross_run(run_dir, reader, batch_size=args.batch_size, limit=args.limit,
                                    device=args.device, student=args.student)
        if args.teacher_layer is not None:
            result["notes"].append("--teacher-layer is not used across tokenizers (spans compare the map's pairs)")
    else:
        result = stages.evaluate_run(run_dir, reader, batch_size=args.batch_size, limit=args.limit,
                                     teacher_layer=args.teacher_layer, device=args.device, student=args.student)
    result["notes"] = score_notes(reader, run_dir, args.cache) + result.get("notes", [])
    result.update(role=role, student=student,
                  cache={"path": path, "label": label, "sequences": result["sequences"], "tokens": result["tokens"],
                         "cache_sequences": reader.num_sequences, "cache_tokens": reader.num_tokens},
                  written_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2) if args.json else format_eval(result, out))
    return 0


def format_eval(result: dict[str, Any], out: Path) -> str:
    """A few readable lines about an evaluation."""
    cache = result["cache"]
    lines = [f"{result['kind']} student ({result['role']}: {result['student']})",
             f"  against {cache['path']} ({cache['label']}): {cache['sequences']:,} of {cache['cache_sequences']:,} "
             f"sequences, {cache['tokens']:,} {result.get('tokens_unit', 'tokens')}"]
    lines += span_lines(result)
    for key, label in (("perplexity", "perplexity"), ("top1_agreement", "top-1 agreement"), ("kl", "KL(t||s)"),
                       ("cosine", "mean cosine"), ("spearman", "Spearman")):
        if isinstance(result.get(key), float):
            lines.append(f"  {label:<16} {result[key]:.4f}")
    for stream, cka in stages.alignment_panels(result).items():
        on_map = ", ".join(f"{p['student']}->{p['teacher']}: " + ("n/a" if p["cka"] is None else f"{p['cka']:.3f}")
                           for p in cka["on_map"]) or "no hidden pairs"
        lines.append(f"  CKA{' (' + stream + ')' if stream else ''} final layers {cka['final']:.4f}; "
                     f"on the layer map: {on_map}")
    lines += [f"  note: {n}" for n in result.get("notes", [])]
    lines.append(f"  written to {out}")
    return "\n".join(lines)


def span_lines(result: dict[str, Any]) -> list[str]:
    """The span metrics of a cross-tokenizer evaluation, one per line (none for other kinds)."""
    if "span_cka" not in result:
        return []
    top1, floor = result.get("span_top1"), result.get("span_top1_floor")
    lines = [f"  {'span top-1':<16} " + ("n/a" if top1 is None else f"{top1:.4f}") + f" over {result['spans']:,} spans"
             + ("" if floor is None else f" (the best constant prediction scores {floor:.4f})"),
             f"  {'aligned share':<16} {result['aligned_share']:.4f}"]
    pairs = [(s, t, f"s{s}_t{t}") for s, t in result.get("pairs", [])]
    for key, label in (("span_cka", "span CKA"), ("span_cosine", "span cosine")):
        values = ", ".join(f"{s}->{t}: " + (f"{result[key][k]:.3f}" if k in result[key] else "n/a")
                           for s, t, k in pairs)
        lines.append(f"  {label:<16} " + (f"{values} ({result['pairs_from']} map)" if pairs else "no layer pairs"))
    return lines
