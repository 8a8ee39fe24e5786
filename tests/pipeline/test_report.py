"""``kdcache report``: valid PNGs and an HTML page, for finished runs, runs in progress, and sweeps.

Run and sweep folders are built by hand, the way training and sweeps write them (including a metrics.jsonl
cut off mid-line, as a live run leaves it), so these tests need no training.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kdcache.pipeline.cli import main
from kdcache.pipeline.report import report_run, report_sweep
from kdcache.pipeline.run_state import read_metrics
from tests.helpers.images import assert_png

EVAL = {"kind": "encoder", "spearman": 0.8, "cosine": 0.7, "notes": [],
        "cka": {"student_layers": [0, 1, 2], "teacher_layers": [2, 4, 6],
                "matrix": [[0.9, 0.7, 0.4], [0.95, 0.8, 0.5], [0.7, 0.75, 0.72]],
                "on_map": [{"student": 1, "teacher": 2, "cka": 0.95}, {"student": 2, "teacher": 6, "cka": 0.72}],
                "mean_on_map": 0.835, "final": 0.72, "tokens": 100}}


def write_run(root: Path, cache: Path | None, steps: int, *, finished: bool, truncate: bool = False,
              evaluation: dict | None = None) -> Path:
    """A run folder as `kdcache train` leaves it, mid-run (no student/) or finished."""
    root.mkdir(parents=True)
    (root / "options.json").write_text(json.dumps({"cache": str(cache) if cache else None, "layer_map": "uniform"}))
    (root / "plan.json").write_text(json.dumps({"total_steps": 100, "hidden_pairs": [[1, 2], [2, 6]]}))
    lines = [json.dumps({"step": s, "time_s": 0.1 * s, "loss": 3.0 / s, "hidden": 2.0 / s, "hidden/s1_t2": 1.0 / s,
                         "hidden/s2_t6": 1.0 / s, "attention": 1.0 / s, "lr": 1e-4}) for s in range(1, steps + 1)]
    text = "\n".join(lines) + "\n"
    if truncate:
        text += lines[-1][: len(lines[-1]) // 2]  # the writer was interrupted mid-line
    (root / "metrics.jsonl").write_text(text)
    if finished:
        (root / "student").mkdir()
        (root / "student" / "config.json").write_text("{}")
    if evaluation:
        (root / "evals").mkdir()
        record = {"role": "trained", "cache": {"path": "/c", "label": "c-1234abcd", "sequences": 3, "tokens": 30},
                  **evaluation}
        (root / "evals" / "trained@c-1234abcd.json").write_text(json.dumps(record))
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.tiny_models import make_tiny_gpt2
    from tests.stages.train._train_support import write_cache

    root = tmp_path_factory.mktemp("report")
    return write_cache(make_tiny_gpt2(root / "teacher"), root / "cache", num_sequences=8, hidden_layers=(1, 3))


def test_read_metrics_skips_a_truncated_last_line(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", None, 5, finished=False, truncate=True)
    records, skipped = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and skipped == 1


def test_report_on_a_run_in_progress(tmp_path: Path, cache: Path) -> None:
    run = write_run(tmp_path / "run", cache, 12, finished=False, truncate=True)
    html = report_run(run).read_text()
    assert_png(run / "report" / "losses.png")
    assert_png(run / "report" / "cache.png")
    assert not (run / "report" / "alignment.png").exists()  # not evaluated yet
    assert "in progress (or stopped): step 12 of 100" in html and "1 unreadable line(s)" in html
    assert html.count("data:image/png;base64,") == 2


def test_report_on_a_run_with_only_its_first_lines(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss"')  # nothing complete yet
    html = report_run(run).read_text()
    assert "No step logged yet" in html and "cache statistics skipped" in html


def test_damaged_evaluation_files_are_skipped(tmp_path: Path, cache: Path) -> None:
    run = write_run(tmp_path / "run", cache, 8, finished=True, evaluation=EVAL)
    (run / "evals" / "trained@junk-1.json").write_text("[1, 2]")
    (run / "evals" / "trained@junk-2.json").write_text('{"cache": "not a record", "role": "trained"}')
    assert main(["report", str(run)]) == 0
    assert "eval_spearman" in (run / "report" / "report.html").read_text()


def test_report_on_a_finished_run_draws_the_alignment_heatmap(tmp_path: Path, cache: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path / "run", cache, 8, finished=True, evaluation=EVAL)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert "report.html" in capsys.readouterr().out
    for name in ("losses.png", "alignment.png", "cache.png"):
        assert_png(tmp_path / "out" / name)
    html = (tmp_path / "out" / "report.html").read_text()
    assert "finished" in html and "eval_spearman" in html and html.count("data:image/png;base64,") == 3


def test_sweep_report_with_finished_running_and_failed_points(tmp_path: Path, cache: Path) -> None:
    sweep = tmp_path / "sweep"
    runs = {"layer_map-uniform": "ok", "layer_map-reverse": "running", "layer_map-explicit_1-9": "failed"}
    records = []
    for i, (name, status) in enumerate(runs.items()):
        run_dir = sweep / "runs" / name
        if status != "failed":
            write_run(run_dir, cache, 10 - 4 * i, finished=status == "ok", truncate=status == "running",
                      evaluation=EVAL if status == "ok" else None)
        else:
            run_dir.mkdir(parents=True)
        record = {"name": name, "values": {"layer_map": name.split("-", 1)[1]}, "run_dir": str(run_dir),
                  "status": status}
        (run_dir / "sweep-run.json").write_text(json.dumps(record))
        if status != "running":
            records.append(record)  # sweep.json lists the runs that have ended
    (sweep / "sweep.json").write_text(json.dumps({"grid": {"layer_map": ["uniform", "explicit:1-9", "reverse"]},
                                                  "cache": str(cache), "runs": records}))
    html = report_sweep(sweep).read_text()
    assert_png(sweep / "report" / "sweep_eval_spearman.png")
    assert_png(sweep / "report" / "sweep_losses.png")
    assert_png(sweep / "report" / "cache.png")
    assert_png(sweep / "runs" / "layer_map-reverse" / "report" / "losses.png")
    for needle in ("class='ok'", "class='failed'", "class='running'", "../runs/layer_map-uniform/report/report.html"):
        assert needle in html, needle
    report_sweep(sweep, metric="loss")
    assert_png(sweep / "report" / "sweep_loss.png")


def test_report_refuses_a_folder_that_is_neither(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "neither a run" in capsys.readouterr().err


@pytest.mark.parametrize("terms, metric, why", [
    ([("ce", "kl", "hidden"), ("ce", "kl")], "ce", "ce, a term every run has: their totals add different terms"),
    ([("ce", "kl"), ("ce", "kl")], "loss", "the total loss: every run optimises the same terms (ce, kl)"),
    ([("ce",), ("hidden",)], None, "the runs share no loss term"),
])
def test_a_sweep_without_eval_compares_like_with_like(tmp_path: Path, terms: list[tuple[str, ...]],
                                                      metric: str | None, why: str) -> None:
    sweep, records = tmp_path / "sweep", []
    for i, names in enumerate(terms):
        run_dir = sweep / "runs" / f"point-{i}"
        run_dir.mkdir(parents=True)
        (run_dir / "options.json").write_text(json.dumps({"cache": None}))
        rows = [{"step": s, "loss": sum(1.0 / s for _ in names), **{n: 1.0 / s for n in names}} for s in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        records.append({"name": f"point-{i}", "values": {"weights": str(i)}, "run_dir": str(run_dir),
                        "status": "ok"})
        (run_dir / "sweep-run.json").write_text(json.dumps(records[-1]))
    (sweep / "sweep.json").write_text(json.dumps({"grid": {"weights": ["0", "1"]}, "runs": records}))
    html = report_sweep(sweep).read_text()
    assert why in html
    charts = sorted(p.name for p in (sweep / "report").glob("sweep_*.png"))
    assert charts == sorted(["sweep_losses.png", *([f"sweep_{metric}.png"] if metric else [])])
    if metric is not None:
        assert_png(sweep / "report" / f"sweep_{metric}.png")
        assert f"<h2>{metric} at each grid point</h2>" in html


def test_run_page_names_the_run_explains_pairs_and_shows_only_what_was_set(tmp_path: Path) -> None:
    from kdcache.pipeline.run_state import applied_options, term_label

    run = write_run(tmp_path / "run", None, 4, finished=True)
    (run / "options.json").write_text(json.dumps({
        "cache": "c", "student": "s", "out": str(run), "lr": 0.01, "batch_size": 8, "layer_map": "uniform",
        "encoder_layer_map": "", "decoder_layer_map": "", "cross_attention_map": "", "delta": 0.0}))
    html = report_run(run).read_text()
    assert "<title>Training run “run”</title>" in html and "kdcache run run" not in html
    kept, others = applied_options(json.loads((run / "options.json").read_text()))
    assert set(kept) == {"cache", "student", "out", "lr"} and others == 6  # batch 8, uniform, delta 0 are defaults
    assert "encoder_layer_map" not in html and "6 other option(s) at their defaults" in html
    assert term_label("hidden/s1_t2") == "hidden: student layer 1 → teacher layer 2"
    assert term_label("attention/s2_t6") == "attention: student layer 2 → teacher layer 6"
    assert term_label("loss") == "loss"


def test_an_ungiven_temperature_is_not_listed_as_set(tmp_path: Path) -> None:
    """options.json holds the temperature a run used, resolved when none was given: that is not a setting."""
    from types import SimpleNamespace

    from kdcache.pipeline.run_state import applied_options
    from kdcache.stages.train.core.options import TrainOptions

    topk = SimpleNamespace(logits="topk")
    for given, listed in ((None, False), (3.0, True)):
        options = TrainOptions.of(cache="c", student="s", out=str(tmp_path), temperature=given)
        written = options.with_cache_defaults(topk)[0].to_dict()  # what the run writes to options.json
        assert written["temperature"] == (given or 2.0)
        assert ("temperature" in applied_options(written)[0]) is listed


def test_report_names_each_metric_and_its_better_direction(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", None, 4, finished=True,
                    evaluation={**EVAL, "kind": "causal_lm", "perplexity": 12.5, "kl": 0.3})
    html = report_run(run).read_text()
    for header in ("Spearman ↑", "cosine ↑", "perplexity ↓", "KL(teacher‖student) ↓", "CKA on the map ↑"):
        assert f">{header}</th>" in html, header
    assert "↑ higher is better, ↓ lower is better" in html and "perplexity ↓ (eval_perplexity)" in html
    assert "student layer 1 → teacher layer 2" in html


def test_step_axis_ticks_are_whole_steps() -> None:
    from kdcache.pipeline.report_plots import _step_axis, plt

    fig, ax = plt.subplots()
    ax.plot([1, 2, 3], [4.0, 3.0, 2.5])  # matplotlib alone ticks this at 1.25, 1.5, ...
    _step_axis(ax)
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 3]
    assert ticks and all(float(t).is_integer() for t in ticks)
    plt.close(fig)


def _demo_like_metrics(steps: int = 30) -> list[dict]:
    """What the demo's run logs: the total, three hidden pairs, three attention pairs and the token count."""
    pairs = ("s1_t2", "s2_t4", "s3_t6")
    return [{"step": s, "loss": 3.0 / s, "hidden": 1.0 / s, **{f"hidden/{p}": 0.3 / s for p in pairs},
             "attention": 2.0 / s, **{f"attention/{p}": 0.6 / s for p in pairs}, "tokens": 1600 + s}
            for s in range(5, 5 * steps + 1, 5)]


def _boxes_of(ax: Any, renderer: Any) -> Any:
    """The axes' own ink, its legend left out: the frame, both axes' ticks and labels, and the title."""
    from matplotlib.transforms import Bbox

    return Bbox.union([ax.get_window_extent(renderer), ax.xaxis.get_tightbbox(renderer),
                       ax.yaxis.get_tightbbox(renderer), ax.title.get_window_extent(renderer)])


def test_loss_legends_overlap_neither_each_other_nor_any_panel() -> None:
    """The demo's losses.png (issue 53): the legends of the hidden and attention panels ran into each other.
    Measured on the laid-out figure the way it is saved, with matplotlib's own renderer extents."""
    from kdcache.pipeline.report_plots import lay_out, loss_figure

    fig = loss_figure(_demo_like_metrics())
    assert fig is not None
    lay_out(fig, "run: loss terms")
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
    legends = [(ax.get_title(), ax.get_legend().get_window_extent(renderer)) for ax in panels if ax.get_legend()]
    assert len(legends) == len(panels) == 4
    for i, (title, box) in enumerate(legends):
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, title
        for other, other_box in legends[i + 1:]:
            assert not box.overlaps(other_box), (title, other)
        for ax in panels:
            assert not box.overlaps(_boxes_of(ax, renderer)), (title, ax.get_title())
