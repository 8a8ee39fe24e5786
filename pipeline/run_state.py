"""What a run directory holds, read the way reports, sweeps and the HTML page need it.

Runs are read while they may still be writing: ``metrics.jsonl`` may end in a half-written line, ``student/``
and ``evals/`` may not exist yet. Shared by ``pipeline.report`` (tables, pages) and ``pipeline.report_plots``;
nothing here imports torch or matplotlib.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdcache import stages
from kdcache.stages.common.option_groups import leaves
from kdcache.stages.common.stream_options import ALIASES
from kdcache.stages.targets.logits.loss_flags import DEFAULT_TEMPERATURE
from kdcache.stages.train.core.options import TrainOptions
from kdcache.storage import read_json_object

META_KEYS = ("step", "time_s", "lr", "epoch", "sample_index", "data_wait_s", "data_wait_share")
# The report's words for each column: (short header, what it measures, higher is better, key in an evaluation
# record: "cka.final" reads eval["cka"]["final"]; "" for a loss term). Raw keys stay in results.csv and --metric;
# the page shows these, with an arrow for the better direction.
METRIC_WORDS: dict[str, tuple[str, str, bool, str]] = {
    "eval_spearman": ("Spearman", "Spearman correlation of the pairwise sentence similarities, student vs teacher",
                      True, "spearman"),
    "eval_cosine": ("cosine", "cosine of the mean-pooled final states, student vs teacher", True, "cosine"),
    "eval_perplexity": ("perplexity", "perplexity of the student on the cached tokens", False, "perplexity"),
    "eval_top1": ("top-1 agreement", "share of tokens where the student's top prediction is the teacher's", True,
                  "top1_agreement"),
    "eval_kl": ("KL(teacher‖student)", "KL divergence from the teacher's to the student's prediction, per token",
                False, "kl"),
    "eval_cka_final": ("CKA, final layers", "linear CKA of the student's and the teacher's final layers", True,
                       "cka.final"),
    "eval_cka_on_map": ("CKA on the map", "mean linear CKA over the layer map's student/teacher pairs", True,
                        "cka.mean_on_map"),
    "eval_attention_kl": ("attention KL", "attention KL(teacher‖student) per query row, mean over the run's block "
                          "pairs (from maps or from queries and keys)", False, "attention.kl"),
    # a --cross-tokenizer run's (kind "cross_tokenizer", stages.train.evaluation.span_eval)
    "eval_span_top1": ("span top-1", "share of aligned spans where the teacher's and the student's top "
                       "predictions name the same next text (students with their own tokenizer)", True, "span_top1"),
    "eval_span_top1_floor": ("span top-1 floor", "what always predicting the teacher's most frequent next text "
                             "scores on the same spans: span top-1 means something only above it", True,
                             "span_top1_floor"),
    "eval_span_cosine": ("span cosine", "cosine of span-pooled hidden states through the run's projectors, mean "
                         "over the layer pairs", True, "span_cosine_mean"),
    "eval_span_cka": ("span CKA", "linear CKA of span-pooled hidden states, mean over the layer pairs (the run's "
                      "map, or the uniform one)", True, "span_cka_mean"),
    "eval_aligned_share": ("aligned share", "share of teacher tokens aligned one to one with a student token",
                           True, "aligned_share"),
    "loss": ("total loss", "the weighted sum of the loss terms", False, ""),
    "ce": ("CE", "cross-entropy on the next token", False, ""),
    "kl": ("KL", "distillation KL on the logits", False, ""),
    "topk_kl": ("top-k KL", "distillation KL on the teacher's top-k logits", False, ""),
    "sampled_kl": ("sampled KL", "distillation KL estimated from sampled ids", False, ""),
    "hidden": ("hidden", "hidden-state loss, summed over layer pairs", False, ""),
    "attention": ("attention", "attention KL, summed over layer pairs", False, ""),
}
# (column, key in an evaluation record), in table order
EVAL_COLUMNS = tuple((column, words[3]) for column, words in METRIC_WORDS.items() if words[3])


def metric_header(column: str) -> str:
    """A table header or axis label: ``eval_spearman`` -> ``Spearman ↑``; other columns unchanged."""
    if column not in METRIC_WORDS:
        return column
    short, _, higher, _ = METRIC_WORDS[column]
    return f"{short} {'↑' if higher else '↓'}"


def higher_is_better(column: str) -> bool:
    """Whether a larger value of a metric or loss column is better (losses, perplexity and KL: no)."""
    return METRIC_WORDS.get(column.split("/")[0], ("", "", False, ""))[2]


def metric_legend(columns: list[str]) -> str:
    """One sentence naming what each known column of a table measures and which way is better."""
    known = [c for c in columns if c in METRIC_WORDS]
    parts = [f"{metric_header(c)} ({c}): {METRIC_WORDS[c][1]}, "
             f"{'higher' if METRIC_WORDS[c][2] else 'lower'} is better" for c in known]
    return ("↑ higher is better, ↓ lower is better. " + "; ".join(parts) + ".") if parts else ""


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], int]:
    """``(records, skipped)`` of the ``metrics.jsonl`` of a run that may still be writing it: every line that
    parses as a JSON object with a step, and how many did not (a live run's truncated last line, typically)."""
    parsed, skipped = stages.read_records(path)
    records = [r for r in parsed if isinstance(r, dict) and "step" in r]
    skipped += len(parsed) - len(records)
    return records, skipped


@dataclass
class RunState:
    """What a run directory holds right now."""

    run_dir: Path
    options: dict[str, Any]
    plan: dict[str, Any]
    metrics: list[dict[str, Any]]
    eval: dict[str, Any] | None  # the newest evaluation of the trained student (alignment heatmap, columns)
    finished: bool
    notes: list[str] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # every evaluation: baseline and trained, per cache

    @property
    def last_step(self) -> int | None:
        return int(self.metrics[-1]["step"]) if self.metrics else None

    @property
    def status(self) -> str:
        """"finished", or how far an unfinished run has got."""
        if self.finished:
            return "finished"
        total = self.plan.get("total_steps")
        where = f"step {self.last_step}" if self.metrics else "no step logged yet"
        return f"in progress (or stopped): {where}" + (f" of {total}" if total else "")


def load_run_state(run_dir: str | Path) -> RunState:
    """Read options, plan, metrics (tolerantly), evaluations (RUN/evals/) and whether the student was exported."""
    root = Path(run_dir)
    metrics, skipped = read_metrics(root / "metrics.jsonl")
    evals = stages.read_evals(root)
    state = RunState(root, read_json_object(root / "options.json"), read_json_object(root / "plan.json"), metrics,
                     stages.newest(evals, "trained"), (root / "student" / "config.json").is_file(),
                     evals=evals)
    if skipped:
        state.notes.append(f"{skipped} unreadable line(s) in metrics.jsonl skipped (a run still writing it)")
    return state


def final_terms(metrics: list[dict[str, Any]]) -> dict[str, float]:
    """The last logged value of every loss term (top-level and per pair), ``{}`` before the first log."""
    if not metrics:
        return {}
    return {k: v for k, v in metrics[-1].items() if k not in META_KEYS and isinstance(v, (int, float))}


def eval_rows(evals: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One table row per evaluation: who was scored, on which cache and how much of it, then its metrics; a
    baseline row sits above the trained one of the same cache, so the table reads baseline → trained."""
    return [{"student": e.get("role"), "cache": e.get("cache", {}).get("label"),
             "sequences": e.get("cache", {}).get("sequences"), "tokens": e.get("cache", {}).get("tokens"),
             **eval_columns(e)} for e in evals]


def eval_columns(evaluation: dict[str, Any] | None) -> dict[str, Any]:
    """The scalar metrics of one evaluation as table columns (absent ones left out)."""
    out: dict[str, Any] = {}
    for column, key in EVAL_COLUMNS:
        value: object = evaluation or {}
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, (int, float)):
            out[column] = value
    return out


# ---- the sweep table ---------------------------------------------------------------------------------------


def term_label(key: str) -> str:
    """``hidden/s1_t4`` -> ``hidden: student layer 1 -> teacher layer 4``; a family name stays as it is."""
    family, _, pair = key.partition("/")
    match = re.fullmatch(r"s(\d+)_t(\d+)", pair)
    if not match:
        return key
    # Attention layer j is the map inside block j, as hidden layer j is its output: "layer" for both.
    return f"{family}: student layer {match[1]} → teacher layer {match[2]}"


def applied_options(options: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The options a run set (those away from their defaults, plus cache, student and out), and how many others
    stayed at their defaults; encoder-decoder options left empty are not options this run used."""
    # options.json holds maps as their text, so the defaults are compared as text too.
    plain = (bool, int, float, str, tuple, type(None))
    defaults = {f.name: f.default if isinstance(f.default, plain) else str(f.default)
                for _, _, f in leaves(TrainOptions) if f.default is not dataclasses.MISSING}
    # runs before per-stream maps wrote each stack's map, "" if not given
    defaults.update(dict.fromkeys(ALIASES, ""))
    # options.json holds the temperature the run used: an ungiven one is resolved (2, or a sampled cache's own).
    defaults["temperature"] = DEFAULT_TEMPERATURE
    kept = {k: v for k, v in options.items()
            if k in ("cache", "student", "out") or k not in defaults or _differs(v, defaults[k])}
    return kept, len(options) - len(kept)


def _differs(value: object, default: object) -> bool:
    return (list(value) if isinstance(value, (list, tuple)) else value) != \
        (list(default) if isinstance(default, (list, tuple)) else default)
