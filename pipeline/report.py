"""``kdcache report``: PNG plots and one HTML page for a run or a sweep, readable while it is still running.

A run's report (in ``RUN/report/``): each loss term over the steps, the student × teacher CKA heatmap when
an evaluation exists (``RUN/evals/``), and the cache's bytes per token per target. A sweep's report (in
``SWEEP/report/``): a bar chart of one metric at each grid point, every run's total loss over the steps, the
comparison table, and a report per run.

Everything is read from what runs leave on disk, written for being read mid-run: ``metrics.jsonl`` may end in
a half-written line, ``student/`` and ``evals/`` may not exist yet. Nothing here imports torch.
"""

from __future__ import annotations

import csv
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kdcache import storage
from kdcache.pipeline.cache_info import describe
from kdcache.pipeline.report_html import markdown_table, render_run, render_sweep
from kdcache.pipeline.run_state import (
    EVAL_COLUMNS,
    META_KEYS,
    RunState,
    eval_columns,
    final_terms,
    higher_is_better,
    load_run_state,
    metric_header,
    term_label,
)
from kdcache.stages.train.evaluation.eval_records import alignment_panels
from kdcache.storage import read_json_object

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

TERM_ORDER = ("loss", "ce", "kl", "topk_kl", "sampled_kl", "hidden", "attention")
GROUP_COLOURS = {"hidden": "tab:blue", "attention": "tab:orange", "logits": "tab:green", "other": "tab:gray"}


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


# ---- plots -------------------------------------------------------------------------------------------------
def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    return plt


# The logged values that are not loss terms, and what their panel's axis counts.
PANEL_UNITS = {"lr": "learning rate", "tokens": "valid tokens since the previous log",
               "aligned_share": "teacher tokens aligned one to one (share)"}


def plot_losses(metrics: list[dict[str, Any]], out: Path, title: str) -> Path | None:
    """``loss_figure`` saved to ``out`` (None before the first logged step)."""
    fig = loss_figure(metrics)
    return None if fig is None else _save(fig, out, title)


def loss_figure(metrics: list[dict[str, Any]]) -> Figure | None:
    """One panel per loss family (``loss``, ``hidden``, ``attention``, ...), its per-pair terms drawn thin."""
    keys = list(dict.fromkeys(k for r in metrics for k, v in r.items()
                              if k not in META_KEYS and isinstance(v, (int, float))))
    families = list(dict.fromkeys(k.split("/")[0] for k in keys))
    if not families:
        return None
    plt = _pyplot()
    cols = min(3, len(families))
    rows = math.ceil(len(families) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
    steps = [r["step"] for r in metrics]
    marker = "o" if len(steps) < 20 else None  # a few points of a young run stay visible
    for ax, family in zip(axes.flat, families):
        members = [k for k in keys if k == family or k.startswith(family + "/")]
        for key in members:
            main = key == family
            ax.plot(steps, [r.get(key, float("nan")) for r in metrics], label=_panel_label(key, len(members) > 1),
                    lw=2.0 if main else 1.0, alpha=1.0 if main else 0.7, marker=marker, ms=3)
        ax.set_title(family)
        _step_axis(ax)
        ax.set_ylabel(PANEL_UNITS.get(family, "loss value"))
        # Below the panel, never on it: a falling curve and its per-pair terms fill every corner of the axes. One
        # column, named without the panel's family, stays as narrow as its panel: two columns of full names were
        # wider, and ran into the next panel's legend.
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=1, frameon=False)
    for ax in list(axes.flat)[len(families):]:
        ax.axis("off")
    return fig


def _panel_label(key: str, has_pairs: bool) -> str:
    """A curve's name inside its family's panel: ``student layer 1 → teacher layer 2`` for a pair, ``sum over the
    pairs`` for the family's total beside its pairs, else the term's own name."""
    label = term_label(key)
    if "/" in key:
        return label.split(": ", 1)[-1]
    return f"{key}: sum over the pairs" if has_pairs else label


def plot_alignment(cka: dict[str, Any], out: Path, title: str) -> Path | None:
    """Heatmap of CKA (student layer × teacher layer), the run's layer-map pairs outlined."""
    plt = _pyplot()
    from matplotlib.patches import Rectangle

    matrix, rows, cols = cka["matrix"], cka["student_layers"], cka["teacher_layers"]
    fig, ax = plt.subplots(figsize=(max(4.5, 1.0 + 0.8 * len(cols)), 1.6 + 0.6 * len(rows)))
    image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="viridis", origin="lower", aspect="auto")
    for i, row in enumerate(matrix):
        for k, value in enumerate(row):
            ax.text(k, i, f"{value:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if value > 0.6 else "white")
    for pair in cka.get("on_map", []):
        if pair["student"] in rows and pair["teacher"] in cols:
            i, k = rows.index(pair["student"]), cols.index(pair["teacher"])
            ax.add_patch(Rectangle((k - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel("teacher layer (cached)")
    ax.set_ylabel("student layer")
    fig.colorbar(image, ax=ax, label="linear CKA")
    return _save(fig, out, title + "\n(red: the run's layer map)")


def cache_stats(cache: str | Path) -> dict[str, Any] | None:
    """``kdcache inspect``'s facts about a cache (bytes per token per array), or None if it cannot be read."""
    try:
        if not cache or not storage.cache_exists(cache):
            return None
        return describe(str(cache))
    except (storage.KdcacheError, OSError, ValueError):
        return None


def plot_cache(info: dict[str, Any], out: Path, title: str) -> Path | None:
    """Horizontal bars: stored bytes per token of every array in the cache, coloured by target kind."""
    arrays = {k: v for k, v in info.get("arrays", {}).items() if v.get("bytes_per_token") is not None}
    if not arrays:
        return None
    plt = _pyplot()
    names = list(arrays)
    values = [arrays[n]["bytes_per_token"] for n in names]
    colours = [GROUP_COLOURS.get(n.split("/")[0], GROUP_COLOURS["other"]) for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.28 * len(names)))
    ax.barh(range(len(names)), values, color=colours)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    for i, value in enumerate(values):
        ax.text(value, i, f" {value:,.0f}", va="center", fontsize=7)
    ax.set_xlabel("stored bytes per token")
    total = info.get("bytes_per_token") or sum(values)
    return _save(fig, out, f"{title}\n{info.get('num_tokens', 0):,} tokens, {total:,.0f} B/token in all")


def plot_sweep_metric(rows: list[dict[str, Any]], metric: str, out: Path, grid_keys: list[str],
                      why: str = "") -> Path | None:
    """A bar per grid point, coloured by the last grid key; failed or unmeasured points are labelled, not drawn.
    The title says which metric ranks the runs, and ``why`` it is the one compared."""
    if not rows:
        return None
    plt = _pyplot()
    values = [r.get(metric) if isinstance(r.get(metric), (int, float)) else None for r in rows]
    shade = grid_keys[-1] if grid_keys else None
    shade_of = lambda row: str(row.get(shade)) if shade else ""  # noqa: E731
    palette = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(shade_of(r) for r in rows))}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(rows) + 1.5), 4.5))
    ax.bar(range(len(rows)), [v or 0.0 for v in values], color=[palette[shade_of(r)] for r in rows])
    for i, (row, value) in enumerate(zip(rows, values)):
        text = f"{value:.3f}" if value is not None else str(row.get("status") or "n/a")
        ax.text(i, value or 0.0, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [_bar_label(r, grid_keys) for r in rows], fontsize=6)
    ax.set_ylabel(metric_header(metric))
    if shade and len(palette) > 1:
        from matplotlib.patches import Patch

        ax.legend([Patch(color=c) for c in palette.values()], [f"{shade}={v}" for v in palette], fontsize=7)
    better = "higher is better" if higher_is_better(metric) else "lower is better"
    title = f"{metric_header(metric)} at each grid point ({better})"
    return _save(fig, out, title + (f"\nranked by {why}" if why else ""))


def _bar_label(row: dict[str, Any], grid_keys: list[str]) -> str:
    """Grid values, one per line, long ones (explicit maps) wrapped at their commas."""
    values = [str(row.get(k, "")).replace(",", ", ") for k in grid_keys] or [row["name"]]
    return "\n".join(line for v in values for line in textwrap.wrap(v, 13))


def plot_sweep_losses(states: dict[str, RunState], out: Path) -> Path | None:
    """Every run's total loss over the steps, on one axis."""
    drawn = {name: s for name, s in states.items() if s.metrics}
    if not drawn:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, state in drawn.items():
        ax.plot([r["step"] for r in state.metrics], [r.get("loss", float("nan")) for r in state.metrics],
                label=name, lw=1.2)
    _step_axis(ax)
    ax.set_ylabel("total loss")
    ax.legend(fontsize=6, ncol=2)
    return _save(fig, out, "total loss of every run (terms differ between runs: compare shapes, not levels)")


def _step_axis(ax: Axes) -> None:
    """Optimizer steps are whole numbers: ticks at integers only (a 20-step run shows no 7.5 or 12.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")


def lay_out(fig: Figure, title: str) -> None:
    """The figure's title, then the layout that keeps titles, labels and legends apart (as ``_save`` saves it)."""
    # Run names of sweep points are long: wrap the title to the figure's width rather than let it run off the page.
    width = max(20, int(fig.get_figwidth() * 11))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    fig.tight_layout()


def _save(fig: Figure, out: Path, title: str) -> Path:
    plt = _pyplot()
    lay_out(fig, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


# ---- whole reports -----------------------------------------------------------------------------------------
def is_sweep(path: Path) -> bool:
    return (path / "sweep.json").is_file() or (path / "runs").is_dir()


def is_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("metrics.jsonl", "options.json", "plan.json"))


def report_run(run_dir: str | Path, out: str | Path | None = None, *, with_cache: bool = True,
               state: RunState | None = None) -> Path:
    """Plots and ``report.html`` for one run (finished or not; ``state`` when the caller has read it already).
    Returns the HTML path."""
    state = state or load_run_state(run_dir)
    out_dir = Path(out) if out else state.run_dir / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = state.run_dir.name
    images = {"losses": plot_losses(state.metrics, out_dir / "losses.png", f"{name}: loss terms")}
    for stream, cka in alignment_panels(state.eval or {}).items():
        suffix = f"-{stream}" if stream else ""
        images[f"alignment{suffix}"] = plot_alignment(cka, out_dir / f"alignment{suffix}.png",
                                                      f"{name}: alignment{' of the ' + stream if stream else ''}")
    info = cache_stats(state.options.get("cache", "")) if with_cache else None
    if info:
        images["cache"] = plot_cache(info, out_dir / "cache.png", f"cache {info['path']}")
    elif with_cache:
        state.notes.append("cache statistics skipped: options.json names no readable cache")
    html = render_run(state, {k: v for k, v in images.items() if v}, info)
    (out_dir / "report.html").write_text(html)
    return out_dir / "report.html"


# span top-1 ranks a sweep of --cross-tokenizer runs (they have no perplexity: their tokens are not the cache's)
EVAL_RANKING = ("eval_spearman", "eval_perplexity", "eval_span_top1", "eval_cka_final", "eval_cka_on_map")
SHARED_TERM_ORDER = TERM_ORDER[1:]  # the term to rank by when totals differ


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
    pick = next((t for t in SHARED_TERM_ORDER if t in shared), min(shared) if shared else None)
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
    images = {"losses": plot_sweep_losses(states, out_dir / "sweep_losses.png")}
    if metric is not None:
        images["metric"] = plot_sweep_metric(rows, metric, out_dir / f"sweep_{metric}.png", grid_keys, why)
    info = cache_stats(summary.get("cache") or next((s.options.get("cache") for s in states.values()), None) or "")
    if info:
        images["cache"] = plot_cache(info, out_dir / "cache.png", f"cache {info['path']}")
    html = render_sweep(root, rows, table_columns(rows, grid_keys, per_pair=False), metric, why,
                        {k: v for k, v in images.items() if v}, links, out_dir)
    (out_dir / "report.html").write_text(html)
    return out_dir / "report.html"

