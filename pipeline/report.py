"""``kdcache report``: PNG plots and one HTML page for a run or a sweep, readable while it is still running, in
``RUN/report/`` or ``SWEEP/report/`` (what each holds: the command's description, ``pipeline.cli.commands.report``).

Everything is read from what runs leave on disk, mid-run too (``pipeline.run_state``), and what a cache holds from
its manifest (``describe``, which ``kdcache inspect`` prints). Nothing here imports torch. The plots are drawn in
``pipeline.report_plots``, loaded only to draw, so the tables (``collect_rows``, ``write_tables``, which ``kdcache
sweep`` writes) need no matplotlib. The pages embed their PNGs as data URIs, so ``report.html`` is one file that
can be copied off a cluster or attached to a message and still shows every plot (the PNGs are also written beside
it).
"""

from __future__ import annotations

import base64
import csv
import html
import os
from collections import Counter
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kdcache import stages, storage
from kdcache.pipeline.run_state import (
    EVAL_COLUMNS,
    RunState,
    applied_options,
    eval_columns,
    eval_rows,
    final_terms,
    load_run_state,
    metric_header,
    metric_legend,
    term_label,
)
from kdcache.stages.train.evaluation.eval_records import alignment_panels
from kdcache.storage import read_json_object

if TYPE_CHECKING:
    from kdcache.storage import CacheSpec

TERM_ORDER = ("loss", "ce", "kl", "topk_kl", "sampled_kl", "hidden", "attention")


def collect_rows(sweep_dir: str | Path, summary: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per run of a sweep: grid values, status, steps, seconds, final loss terms, eval metrics.

    Records come from ``summary["runs"]`` (or ``SWEEP/sweep.json``), completed by each run's own
    ``sweep-run.json``, so a sweep still running shows its finished, running and failed points. Each run is read
    at ``SWEEP/runs/NAME``, so a moved sweep folder still reports.
    """
    records = sweep_records(sweep_dir, summary)
    return [_row(record, load_run_state(Path(sweep_dir) / "runs" / name)) for name, record in records.items()]


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


# ---- a cache ----------------------------------------------------------------------------------------------
def _ratio(decoded: int, stored: int) -> float | None:
    return round(decoded / stored, 3) if stored else None


def _against_fp16(spec: CacheSpec, arrays: dict[str, dict[str, Any]], tokens: int) -> None:
    """Give each coded hidden array ``fp16_ratio``: the fp16 bytes of the values it stands for over the stored bytes
    of its codes and companions (scales, outliers). Its own ``compression_ratio`` compares the codes with their
    int8 bytes only (int7's 1.26 is 2.2x against fp16). Projected (rank < d) codecs are left out: their fp16
    width is not the codes'."""
    codec = spec.hidden_codec
    if codec.float_dtype or (codec.rank and not codec.full_rank):
        return
    for name, info in arrays.items():
        if not spec.coded(name) or not tokens:
            continue
        width = int(info["shape_tail"][-1]) * codec.per_code
        stored = sum(arrays[part]["stored_bytes"] for part in spec.with_parts(name) if part in arrays)
        info["fp16_ratio"] = _ratio(2 * width * tokens, stored)


def describe(path: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as a JSON-ready dict (``num_tokens`` is a plain integer).

    Raises:
        KdcacheError: missing or corrupt manifest, newer format version.
    """
    reader = storage.CacheReader(path, allow_partial=True)
    spec, manifest = reader.spec, reader.manifest
    tokens = reader.num_tokens
    records = reader.records  # for a partial cache: what is committed so far
    arrays = storage.summarize_arrays(spec, records)
    for info in arrays.values():
        info["bytes_per_token"] = round(info["stored_bytes"] / tokens, 2) if tokens else None
        info["decoded_bytes_per_token"] = round(info["decoded_bytes"] / tokens, 2) if tokens else None
        info["compression_ratio"] = _ratio(info["decoded_bytes"], info["stored_bytes"])
        info["codec_label"] = storage.describe_codec(info["codec"])
    _against_fp16(spec, arrays, tokens)
    stored = sum(r.stored_bytes for r in records)
    decoded = sum(r.decoded_bytes for r in records)
    return {
        "path": str(path), "status": manifest.status, "format_version": manifest.format_version,
        "backend": spec.backend, "features": list(spec.features), "hidden_layers": list(spec.hidden_layers),
        "attention_layers": list(spec.attention_layers), "layout": "seq2seq" if spec.is_encoder_decoder else "single",
        "streams": {stream or "tokens": {"hidden_layers": list(hidden), "attention_layers": list(attention)}
                    for stream, hidden, attention in spec.stream_layers()},
        "cross_attention_layers": list(spec.layers_of("cross_attention", "decoder")),
        "attention_heads": None if spec.attention_heads is None else list(spec.attention_heads),
        "attention_triangle": spec.attention_triangle, "attention_source": spec.attention_source,
        "attention_scores": spec.attention_scores, "logits": spec.logits, "top_k": spec.top_k,
        "samples": spec.samples, "sample_temperature": spec.sample_temperature,
        "vocab_size": spec.vocab_size, "dtype": spec.dtype, "bitround": spec.bitround,
        "hidden_codec": spec.hidden_codec.record(), "hidden_codec_text": spec.hidden_codec.describe(),
        "codecs": {"activations": spec.codec, "topk": spec.topk_codec},
        "num_sequences": spec.num_sequences, "num_committed_sequences": sum(r.seq_stop - r.seq_start for r in records),
        "num_tokens": int(tokens), "num_shards": spec.num_shards, "num_committed_shards": len(records),
        "stored_bytes": stored, "decoded_bytes": decoded,
        "bytes_per_token": round(stored / tokens, 2) if tokens else None,
        "compression_ratio": _ratio(decoded, stored), "arrays": arrays, "fingerprints": reader.fingerprints,
        "created_at": manifest.created_at, "updated_at": manifest.updated_at, "texts": stages.has_texts(reader.store),
    }


def cache_stats(cache: str | Path) -> dict[str, Any] | None:
    """``kdcache inspect``'s facts about a cache (bytes per token per array), or None if it cannot be read."""
    try:
        if not cache or not storage.cache_exists(cache):
            return None
        return describe(str(cache))
    except (storage.KdcacheError, OSError, ValueError):
        return None


# ---- pages ----------------------------------------------------------------------------------------------
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


def page(title: str, sections: list[str], out_dir: Path) -> Path:
    """A complete HTML document, written to ``out_dir/report.html``; returns its path."""
    (out_dir / "report.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{''.join(sections)}</body></html>\n")
    return out_dir / "report.html"


def _key_values(pairs: dict[str, Any]) -> str:
    rows = "".join(f"<tr><td class=text>{html.escape(str(k))}</td><td class=text>{html.escape(fmt(v))}</td></tr>"
                   for k, v in pairs.items())
    return f"<table>{rows}</table>"


def _notes(notes: list[str]) -> str:
    return "".join(f"<p class=note>{html.escape(n)}</p>" for n in notes if n)


def render_run(state: RunState, images: dict[str, Path], out_dir: Path) -> Path:
    """The page of one run (status, final terms, eval metrics, plots, options), written into ``out_dir``."""
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
    return page(f"Training run “{state.run_dir.name}”", sections, out_dir)


def render_sweep(root: Path, rows: list[dict[str, Any]], columns: list[str], metric: str | None, why: str,
                 images: dict[str, Path], run_reports: dict[str, Path], out_dir: Path) -> Path:
    """The page of a sweep (the comparison table, names linking to each run's report, and the sweep plots),
    written into ``out_dir``."""
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
    return page(f"Sweep “{root.name}”", sections, out_dir)


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
    return render_run(state, {k: v for k, v in images.items() if v}, out_dir)


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
    # each run read once for the table, the plots and the run pages (at SWEEP/runs/NAME, as collect_rows reads it)
    states = {name: load_run_state(root / "runs" / name) for name in records}
    rows = [_row(record, states[name]) for name, record in records.items()]
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
    return render_sweep(root, rows, table_columns(rows, grid_keys, per_pair=False), metric, why,
                        {k: v for k, v in images.items() if v}, links, out_dir)

