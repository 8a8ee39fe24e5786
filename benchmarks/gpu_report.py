"""The prepared GPU check's results as one RESULTS.md block (``benchmarks/gpu_check.sh`` runs it last).

Reads what the check left in its folder: ``card.txt`` (the card, driver and versions), ``status.txt`` (each step's
exit status), ``kernel_tests.xml`` (pytest's junit), ``vocab.json`` (``bench_vocab_losses``) and ``gpu.json``
(``bench_gpu``; where it is missing, the JSON rows ``bench_gpu.log`` printed before it stopped), ``generate.json``
(``bench_generate``) and ``draft.json`` (``bench_draft``). Writes markdown: the card, the kernel tests' counts, the
kernel against the pure-torch chunks per loss, each of issue 50's targets with the figure measured and whether it
is met, generation with capture against bare ``generate`` (issue 58: ≥ 0.9×), and the drafts' tau and speed-up
(issue 59). A step that did not run shows as missing, never as met.

Usage: ``python benchmarks/gpu_report.py OUT_FOLDER > gpu.md``.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# (what, section, run, figure key, the least it must reach (None: at most `most`), the most it may reach)
TARGETS: list[tuple[str, str, str, str, float | None, float | None]] = [
    ("stage two CE + top-128 KL vs the student alone", "stage_two", "kdcache CE + top-k KL", "vs_student_alone",
     0.95, None),
    ("stage two all terms vs the student alone", "stage_two", "kdcache CE + top-k KL + hidden MSE",
     "vs_student_alone", 0.9, None),
    ("stage two all terms' peak memory vs the student alone's", "stage_two", "kdcache CE + top-k KL + hidden MSE",
     "peak_vs_student_alone", None, 0.7),
    ("stage one 4 fp16 hidden layers vs forward + head", "stage_one", "+4 hidden fp16", "vs_forward_head", 0.85, None),
    ("stage one pca8 vs forward + head", "stage_one", "+4 hidden pca8", "vs_forward_head", 0.5, None),
    ("stage one logits only, compiled, vs the eager forward + head", "stage_one", "logits only, compiled",
     "vs_forward_head", 1.0, None),
]


def load(folder: Path) -> dict[str, Any]:
    """Everything the check left: ``{"card", "status", "tests", "vocab", "gpu"}`` (None where a file is missing)."""
    def text(name: str) -> str | None:
        path = folder / name
        return path.read_text().strip() if path.exists() else None

    vocab, generate, draft = text("vocab.json"), text("generate.json"), text("draft.json")
    return {"card": text("card.txt"), "status": text("status.txt"), "tests": _junit(folder / "kernel_tests.xml"),
            "vocab": json.loads(vocab)["rows"] if vocab else None, "gpu": _bench_gpu(folder),
            "generate": json.loads(generate) if generate else None,
            "draft": json.loads(draft)["rows"] if draft else None}


def _junit(path: Path) -> dict[str, int] | None:
    if not path.exists():
        return None
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    return {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}


def _bench_gpu(folder: Path) -> dict[str, Any] | None:
    """``gpu.json``, or the rows ``bench_gpu.log`` printed (one JSON object a line) where the step was cut off."""
    whole = folder / "gpu.json"
    if whole.exists():
        return dict(json.loads(whole.read_text()))
    log = folder / "bench_gpu.log"
    if not log.exists():
        return None
    rows = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{\"run\"")]
    return {"stage_one": rows, "cut_off": True}


def with_peak_ratios(gpu: dict[str, Any]) -> dict[str, Any]:
    """Stage two's rows with ``peak_vs_student_alone`` (the first row is the student alone)."""
    rows = gpu.get("stage_two") or []
    alone = rows[0]["peak_gib"] if rows else 0.0
    for row in rows:
        row["peak_vs_student_alone"] = round(row["peak_gib"] / alone, 3) if alone else None
    return gpu


def target_lines(gpu: dict[str, Any] | None) -> list[str]:
    """A table row per target: the figure, the bound, and met / missed / missing."""
    lines = ["| target | measured | bound | verdict |", "| --- | --- | --- | --- |"]
    for what, section, run, key, least, most in TARGETS:
        row = next((r for r in (gpu or {}).get(section) or [] if r.get("run") == run), None)
        value = None if row is None else row.get(key)
        bound = f"≥ {least}" if least is not None else f"≤ {most}"
        if value is None:
            verdict = "missing"
        else:
            met = (least is None or value >= least) and (most is None or value <= most)
            verdict = "**met**" if met else "missed"
        lines.append(f"| {what} | {'—' if value is None else value} | {bound} | {verdict} |")
    return lines


def vocab_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """The kernel ("head") against the pure-torch chunks ("head_chunks") per loss: time, memory, value."""
    if not rows:
        return ["bench_vocab_losses: missing"]
    lines = ["| loss | kernel s | pure-torch s | kernel × pure-torch | peak MiB kernel / pure-torch | values |",
             "| --- | --- | --- | --- | --- | --- |"]
    by = {(r["loss"], r["side"]): r for r in rows}
    for loss in dict.fromkeys(r["loss"] for r in rows):
        fused, chunks = by.get((loss, "head")), by.get((loss, "head_chunks"))
        if fused is None or chunks is None:
            continue
        lines.append(f"| {loss} | {fused['seconds']:.4f} | {chunks['seconds']:.4f} | "
                     f"{fused['seconds'] / chunks['seconds']:.2f} | {fused['peak_bytes'] / 2**20:.0f} / "
                     f"{chunks['peak_bytes'] / 2**20:.0f} | {fused['value']:.6g} / {chunks['value']:.6g} |")
    return lines


GENERATE_LEAST = 0.9  # issue 58: generation with capture at least 0.9x bare generate's tokens/s


def generate_lines(rows: list[dict[str, Any]] | None) -> list[str]:
    """Generation with capture against bare ``model.generate``, a row per shape, with the issue's bound."""
    if not rows:
        return ["bench_generate: missing"]
    lines = ["| batch × prompt × new | generate tok/s | capture tok/s | capture × generate | verdict |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        rate = r["tokens_per_second"]
        verdict = "**met**" if r["ratio"] >= GENERATE_LEAST else "missed"
        lines.append(f"| {r['batch']} × {r['prompt']} × {r['new']} | {rate['generate']:,.0f} | "
                     f"{rate['capture']:,.0f} | {r['ratio']:.2f} (≥ {GENERATE_LEAST}) | {verdict} |")
    return lines


def draft_lines(rows: dict[str, Any] | None) -> list[str]:
    """Each drafter's acceptance length tau and speed-up over the target alone (draft-eval on the GPU)."""
    if not rows:
        return ["bench_draft: missing"]
    lines = ["| draft | tau | speed-up |", "| --- | --- | --- |"]
    for name, f in rows.items():
        tau = "—" if f.get("tau") is None else f"{f['tau']:.2f}"
        lines.append(f"| {name} | {tau} | {f['speedup']:.2f}× |")
    return lines


def report(folder: Path) -> str:
    found = load(folder)
    gpu = None if found["gpu"] is None else with_peak_ratios(found["gpu"])
    tests = found["tests"]
    lines = [f"### GPU check ({(found['card'] or 'card unknown').splitlines()[0]})", "",
             f"Versions: {' '.join((found['card'] or '').splitlines()[1:]) or 'unknown'}.", "",
             "Steps: " + "; ".join((found["status"] or "none ran").splitlines()) + ".", "",
             "Kernel tests on CUDA: " + ("missing" if tests is None else
                                         ", ".join(f"{v} {k}" for k, v in tests.items())) + ".", "",
             *vocab_lines(found["vocab"]), "", *target_lines(gpu), "", *generate_lines(found["generate"]), "",
             *draft_lines(found["draft"])]
    if gpu and gpu.get("cut_off"):
        lines += ["", "bench_gpu was cut off: the stage one rows above are those it printed before."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(report(Path(sys.argv[1])))
