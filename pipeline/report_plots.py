"""The PNG plots of ``kdcache report`` (``pipeline.report``): loss terms, the CKA heatmap, the cache's bytes per
token, and a sweep's metric bars and loss curves, each saved at 110 dpi with its title laid out.

matplotlib (the ``plots`` extra) loads with this module, which ``pipeline.report`` imports only when it draws: the
``kdcache`` command and every other report function stay without it.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, never a display; set before pyplot loads
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from kdcache.pipeline.run_state import META_KEYS, RunState, higher_is_better, metric_header, term_label  # noqa: E402

GROUP_COLOURS = {"hidden": "tab:blue", "attention": "tab:orange", "logits": "tab:green", "other": "tab:gray"}

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


def plot_cache(info: dict[str, Any], out: Path, title: str) -> Path | None:
    """Horizontal bars: stored bytes per token of every array in the cache, coloured by target kind."""
    arrays = {k: v for k, v in info.get("arrays", {}).items() if v.get("bytes_per_token") is not None}
    if not arrays:
        return None
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
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")


def lay_out(fig: Figure, title: str) -> None:
    """The figure's title, then the layout that keeps titles, labels and legends apart (as ``_save`` saves it)."""
    # Run names of sweep points are long: wrap the title to the figure's width rather than let it run off the page.
    width = max(20, int(fig.get_figwidth() * 11))
    fig.suptitle("\n".join(textwrap.fill(line, width) for line in title.split("\n")), fontsize=10)
    fig.tight_layout()


def _save(fig: Figure, out: Path, title: str) -> Path:
    lay_out(fig, title)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
