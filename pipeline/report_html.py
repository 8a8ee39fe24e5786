"""Rendering for ``kdcache report``: the Markdown results table and the HTML pages.

The pages embed their PNGs as data URIs, so ``report.html`` is one file that can be copied off a cluster or
attached to a message and still shows every plot (the PNGs are also written beside it).
"""

from __future__ import annotations

import base64
import html
import os
from collections import Counter
from pathlib import Path
from typing import Any

from kdcache.pipeline.run_state import (
    RunState,
    applied_options,
    eval_rows,
    final_terms,
    metric_header,
    metric_legend,
    term_label,
)

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
table { border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: right; }
th { background: #f2f2f2; } td.text { text-align: left; }
tr.failed td { background: #fde2e2; } tr.running td { background: #fff6d6; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
.note { color: #8a5a00; } code { background: #f5f5f5; padding: 0 3px; }
"""


def fmt(value: object) -> str:
    """A table cell: 4 significant digits for floats, blank for missing values."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A GitHub-flavoured Markdown table of ``rows`` restricted to ``columns`` (a ``|`` in a cell escaped)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(fmt(row.get(c)).replace("|", "\\|") for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def html_table(rows: list[dict[str, Any]], columns: list[str], links: dict[str, str] | None = None) -> str:
    """An HTML table; a row's ``status`` sets its class, and ``links[name]`` turns its name into a link.
    Metric columns get their human name and better direction as header, the raw key as its tooltip."""
    head = "".join(f"<th title='{html.escape(c)}'>{html.escape(metric_header(c))}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for column in columns:
            text = html.escape(fmt(row.get(column)))
            if column == "name" and links and row.get("name") in links:
                text = f'<a href="{html.escape(links[row["name"]])}">{text}</a>'
            numeric = isinstance(row.get(column), (int, float))
            cells.append(f"<td{'' if numeric else ' class=text'}>{text}</td>")
        status = str(row.get("status") or "")
        body.append(f"<tr class='{html.escape(status)}'>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def image(path: Path, alt: str) -> str:
    """An ``<img>`` with the PNG inlined."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def page(title: str, sections: list[str]) -> str:
    """A complete HTML document."""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>\n")


def _key_values(pairs: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td class=text>{html.escape(str(k))}</td><td class=text>{html.escape(fmt(v))}</td></tr>"
                   for k, v in pairs.items())
    return f"<table>{rows}</table>"


def _notes(notes: list[str]) -> str:
    return "".join(f"<p class=note>{html.escape(n)}</p>" for n in notes if n)


def render_run(state: RunState, images: dict[str, Path]) -> str:
    """The page of one run: status, final terms, eval metrics, plots, options."""

    sections = [f"<p>{html.escape(str(state.run_dir))} — <b>{html.escape(state.status)}</b></p>",
                _notes(state.notes)]
    if state.metrics:
        terms = {term_label(k): v for k, v in final_terms(state.metrics).items()}
        sections += ["<h2>Loss terms at the last logged step</h2>", _key_values(terms),
                     _notes(["Lower is better for every loss term."])]
    sections += [image(images["losses"], "loss terms")] if "losses" in images else ["<p>No step logged yet.</p>"]
    if state.evals:
        rows = eval_rows(state.evals)
        columns = list(dict.fromkeys(c for row in rows for c in row))
        caches = {e["cache"]["label"]: e["cache"]["path"] for e in state.evals if "cache" in e}
        sections += ["<h2>Evaluations (baseline → trained, per cache)</h2>", html_table(rows, columns),
                     _notes([metric_legend(columns)]),
                     _notes([f"cache {label}: {path}" for label, path in caches.items()]),
                     _notes((state.eval or {}).get("notes", []))]
    for key in [k for k in images if k.startswith("alignment")]:
        stack = f" ({key.partition('-')[2]} stack)" if "-" in key else ""
        sections += [f"<h2>Alignment{stack}: linear CKA, student layer × cached teacher layer</h2>",
                     image(images[key], "alignment heatmap")]
    if "cache" in images:  # drawn only from a readable cache
        sections += ["<h2>Cache</h2>", image(images["cache"], "cache bytes per token")]
    if state.options:
        kept, others = applied_options(state.options)
        sections += ["<h2>Options this run set</h2>", _key_values(kept),
                     _notes([f"{others} other option(s) at their defaults (RUN/options.json has them all)"])]
    return page(f"Training run “{state.run_dir.name}”", sections)


def render_sweep(root: Path, rows: list[dict[str, Any]], columns: list[str], metric: str | None, why: str,
                 images: dict[str, Path], run_reports: dict[str, Path], out_dir: Path) -> str:
    """The page of a sweep: the comparison table (names link to each run's report) and the sweep plots."""
    links = {name: os.path.relpath(path, out_dir) for name, path in run_reports.items()}
    counts = Counter(str(row.get("status")) for row in rows)
    sections = [f"<p>{html.escape(str(root))} — {len(rows)} run(s): "
                + ", ".join(f"{n} {html.escape(s)}" for s, n in counts.items()) + "</p>",
                "<h2>Results</h2>", html_table(rows, columns, links), _notes([metric_legend(columns)])]
    if "metric" in images and metric:
        sections += [f"<h2>{html.escape(metric)} at each grid point</h2>",
                     f"<p class=note>{html.escape(metric_header(metric))}; ranked by {html.escape(why)}.</p>",
                     image(images["metric"], metric)]
    elif metric is None:
        sections += [f"<p class=note>No ranking chart: {html.escape(why)}.</p>"]
    if "losses" in images:
        sections += ["<h2>Loss curves</h2>", image(images["losses"], "loss curves")]
    if "cache" in images:
        sections += ["<h2>Cache (shared by every run)</h2>", image(images["cache"], "cache bytes per token")]
    failed = [r["name"] for r in rows if r.get("status") == "failed"]
    if failed:
        sections.append(_notes([f"failed: {', '.join(failed)} — see runs/<name>/train.log or sweep.json"]))
    return page(f"Sweep “{root.name}”", sections)
