"""``kdcache report``: PNG plots and one HTML page for a run or a sweep, readable while it is still running, in
``RUN/report/`` or ``SWEEP/report/`` (what each holds: the command's description, ``pipeline.cli.commands.report``).

Everything is read from what runs leave on disk, mid-run too (``pipeline.run_state``). Nothing here imports
torch. The plots are drawn in ``pipeline.report_plots``, loaded only to draw, so the tables (``collect_rows``,
``write_tables``, which ``kdcache sweep`` writes) need no matplotlib.
"""

from __future__ import annotations

import csv
from pathlib import Path
from types import ModuleType
from typing import Any

from kdcache import storage
from kdcache.pipeline.cache_info import describe
from kdcache.pipeline.report_html import markdown_table, render_run, render_sweep
from kdcache.pipeline.run_state import (
    EVAL_COLUMNS,
    RunState,
    eval_columns,
    final_terms,
    load_run_state,
)
from kdcache.stages.train.evaluation.eval_records import alignment_panels
from kdcache.storage import read_json_object

TERM_ORDER = ("loss", "ce", "kl", "topk_kl", "sampled_kl", "hidden", "attention")


def collect_rows(sweep_dir: str | Path, summary: dict[str, Any] | None = None,
                 states: dict[str, RunState] | None = None) -> list[dict[str, Any]]:
    """One row per run of a sweep: grid values, status, steps, seconds, final loss terms, eval metrics.

    Records come from ``summary["runs"]`` (or ``SWEEP/sweep.json``), completed by each run's own
    ``sweep-run.json``, so a sweep still running shows its finished, running and failed points.
    """
    records = sweep_records(sweep_dir, summary)
    states = states if states is not None else run_states(Path(sweep_dir), records)
    return [_row(record, states[name]) for name, record in records.items()]


def run_states(sweep_dir: Path, records: dict[str, dict[str, Any]]) -> dict[str, RunState]:
    """Each run's state (``SWEEP/runs/NAME``, so a moved sweep folder still reports), read once for the table,
    the plots and the run pages."""
    return {name: load_run_state(sweep_dir / "runs" / name) for name in records}


def sweep_records(sweep_dir: str | Path, summary: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """Run records by name: the sweep's own list first, then any run folder's ``sweep-run.json`` it lacks."""
    root = Path(sweep_dir)
    summary = summary if summary is not None else read_json_object(root / "sweep.json")
    records = {r["name"]: r for r in summary.get("runs", [])}
    for path in sorted((root / "runs").glob("*/sweep-run.json")):
        record = read_json_object(path)
        if record.get("name") and record["name"] not in records:
            records[record["name"]] = record
    return records


def _row(record: dict[str, Any], state: RunState) -> dict[str, Any]:
    row: dict[str, Any] = {"name": record["name"], **record.get("values", {}), "status": record.get("status"),
                           "steps": state.last_step, "seconds": record.get("seconds")}
    if record.get("status") == "running" and state.finished:
        row["status"] = "ok"
    row.update(final_terms(state.metrics))
    row.update(eval_columns(state.eval))
    return row


def table_columns(rows: list[dict[str, Any]], grid_keys: list[str], *, per_pair: bool) -> list[str]:
    """Column order: name, grid values, status, steps, seconds, loss terms, eval metrics."""
    seen = list(dict.fromkeys(k for row in rows for k in row))
    fixed = ["name", *grid_keys, "status", "steps", "seconds"]
    terms = [t for t in TERM_ORDER if t in seen] + sorted(
        k for k in seen if k not in fixed and k not in TERM_ORDER and not k.startswith("eval_")
        and (per_pair or "/" not in k))
    evals = [c for c, _ in EVAL_COLUMNS if c in seen]
    return fixed + terms + evals


def write_tables(sweep_dir: str | Path, rows: list[dict[str, Any]], grid_keys: list[str]) -> tuple[Path, Path]:
    """Write ``results.csv`` (every term, per-pair ones too) and ``results.md`` (top-level terms)."""
    root = Path(sweep_dir)
    columns = table_columns(rows, grid_keys, per_pair=True)
    with open(root / "results.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    md = markdown_table(rows, table_columns(rows, grid_keys, per_pair=False))
    (root / "results.md").write_text(md + "\n")
    return root / "results.csv", root / "results.md"


def _plots() -> ModuleType:
    """``pipeline.report_plots``, loaded on the first drawing: it imports matplotlib, an optional extra."""
    from kdcache.pipeline import report_plots  # matplotlib: the `plots` extra, and only when a report draws

    return report_plots


def cache_stats(cache: str | Path) -> dict[str, Any] | None:
    """``kdcache inspect``'s facts about a cache (bytes per token per array), or None if it cannot be read."""
    try:
        if not cache or not storage.cache_exists(cache):
            return None
        return describe(str(cache))
    except (storage.KdcacheError, OSError, ValueError):
        return None


# ---- whole reports -----------------------------------------------------------------------------------------
def report_run(run_dir: str | Path, out: str | Path | None = None, *, with_cache: bool = True,
               state: RunState | None = None) -> Path:
    """Plots and ``report.html`` for one run (finished or not; ``state`` when the caller has read it already).
    Returns the HTML path."""
    state = state or load_run_state(run_dir)
    out_dir = Path(out) if out else state.run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = state.run_dir.name
    plots = _plots()
    images = {"losses": plots.plot_losses(state.metrics, out_dir / "losses.png", f"{name}: loss terms")}
    for stream, cka in alignment_panels(state.eval or {}).items():
        suffix = f"-{stream}" if stream else ""
        images[f"alignment{suffix}"] = plots.plot_alignment(cka, out_dir / f"alignment{suffix}.png",
                                                            f"{name}: alignment{' of the ' + stream if stream else ''}")
    info = cache_stats(state.options.get("cache", "")) if with_cache else None
    if info:
        images["cache"] = plots.plot_cache(info, out_dir / "cache.png", f"cache {info['path']}")
    elif with_cache:
        state.notes.append("cache statistics skipped: options.json names no readable cache")
    html = render_run(state, {k: v for k, v in images.items() if v})
    (out_dir / "report.html").write_text(html)
    return out_dir / "report.html"


# span top-1 ranks a sweep of --cross-tokenizer runs (they have no perplexity: their tokens are not the cache's)
EVAL_RANKING = ("eval_spearman", "eval_perplexity", "eval_span_top1", "eval_cka_final", "eval_cka_on_map")


def default_metric(rows: list[dict[str, Any]], states: dict[str, RunState]) -> tuple[str | None, str]:
    """What the sweep chart ranks runs by, and why: an eval metric when there is one; else the total loss when
    every run optimises the same terms; else a term every run shares. Never totals of different objectives.

    Returns:
        ``(column or None, explanation)``; None when the runs share no term (no chart is drawn).
    """
    for column in EVAL_RANKING:
        if any(isinstance(r.get(column), (int, float)) for r in rows):
            return column, "an eval metric on the held-out cache"
    terms = [{k for k in final_terms(s.metrics) if "/" not in k} - {"loss"} for s in states.values() if s.metrics]
    if not terms:
        return "loss", "no run has logged a step yet"
    if all(t == terms[0] for t in terms):
        return "loss", f"the total loss: every run optimises the same terms ({', '.join(sorted(terms[0]))})"
    shared = set.intersection(*terms)
    pick = next((t for t in TERM_ORDER[1:] if t in shared), min(shared) if shared else None)  # a term, not "loss"
    if pick is None:
        return None, "the runs share no loss term, so no metric compares them; add --eval-cache to the sweep"
    return pick, (f"{pick}, a term every run has: their totals add different terms and are not comparable "
                  f"(add --eval-cache for an eval metric)")


def report_sweep(sweep_dir: str | Path, out: str | Path | None = None, *, metric: str | None = None) -> Path:
    """The sweep page (table, metric bars, loss curves) and a report per run. Returns the HTML path."""
    root = Path(sweep_dir)
    out_dir = Path(out) if out else root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = read_json_object(root / "sweep.json")
    records = sweep_records(root, summary)
    states = run_states(root, records)
    rows = collect_rows(root, summary, states)
    grid_keys = list(summary.get("grid", {})) or list(dict.fromkeys(
        k for r in records.values() for k in r.get("values", {})))
    metric, why = (metric, "chosen with --metric") if metric else default_metric(rows, states)
    links = {name: report_run(state.run_dir, with_cache=False, state=state)
             for name, state in states.items() if state.metrics}
    plots = _plots()
    images = {"losses": plots.plot_sweep_losses(states, out_dir / "sweep_losses.png")}
    if metric is not None:
        images["metric"] = plots.plot_sweep_metric(rows, metric, out_dir / f"sweep_{metric}.png", grid_keys, why)
    info = cache_stats(summary.get("cache") or next((s.options.get("cache") for s in states.values()), None) or "")
    if info:
        images["cache"] = plots.plot_cache(info, out_dir / "cache.png", f"cache {info['path']}")
    html = render_sweep(root, rows, table_columns(rows, grid_keys, per_pair=False), metric, why,
                        {k: v for k, v in images.items() if v}, links, out_dir)
    (out_dir / "report.html").write_text(html)
    return out_dir / "report.html"

