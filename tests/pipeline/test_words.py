"""Words that mislead no more (issue 32), each through the command a user runs, in its own process.

``inspect`` names int7's rotation by its seed, shows pca8 only the settings it uses and a coded hidden array's
size against fp16; a hub name without a hub fails after one try; ``train``'s loss weights follow the cache and the
student when not given, and it says so first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdcache.pipeline.children import child_env
from tests.helpers.tiny_models import sample_texts, write_text_dataset


def _kdcache(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kdcache", *argv], capture_output=True, text=True, timeout=600,
                          env={**child_env(HF_HUB_OFFLINE="1"), **env})


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "data.jsonl", sample_texts(16))


def test_inspect_names_the_codec_settings_it_uses_and_the_size_against_fp16(tiny_gpt2: Path, data: Path,
                                                                              tmp_path: Path) -> None:
    base = ["precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--features", "hidden", "--layers",
            "1,3", "--no-progress"]
    assert _kdcache(*base, "--out", str(tmp_path / "int7"), "--hidden-codec", "int7").returncode == 0
    assert _kdcache(*base, "--out", str(tmp_path / "pca8"), "--hidden-codec", "pca8", "--hidden-rank",
                    "32").returncode == 0
    int7 = _kdcache("inspect", str(tmp_path / "int7")).stdout
    line = next(line for line in int7.splitlines() if "hidden codec" in line)
    assert line.endswith("hidden codec int7 (rotation seed 0, outliers 4)"), line  # no group: int7 has one scale
    ratios = [float(line.split("  ")[-1].split("x smaller than fp16")[0]) for line in int7.splitlines()
              if line.startswith("hidden/") and "x smaller than fp16" in line]
    assert len(ratios) == 2 and all(1.8 < r < 3.0 for r in ratios), int7  # codes, scales and outliers together
    info = json.loads(_kdcache("inspect", str(tmp_path / "int7"), "--json").stdout)
    assert info["arrays"]["hidden/1"]["fp16_ratio"] > info["arrays"]["hidden/1"]["compression_ratio"]
    pca8 = _kdcache("inspect", str(tmp_path / "pca8")).stdout
    line = next(line for line in pca8.splitlines() if "hidden codec pca8" in line)
    assert "no rotation" in line and "None" not in line and "group" not in line and "step 0.24" in line, line


def test_a_hub_name_without_a_hub_fails_after_one_try(data: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in child_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"))  # nothing listens on port 9
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kdcache", "precompute", "--teacher", "some-org/some-model",
                           "--data", str(data), "--out", str(tmp_path / "c"), "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)
    took = time.perf_counter() - started
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "the hub (http://127.0.0.1:9) cannot be reached" in proc.stderr and "some-org/some-model" in proc.stderr
    assert "Retrying" not in proc.stderr and took < 60, (took, proc.stderr[-2000:])  # huggingface_hub's five
    assert not (tmp_path / "c").exists()


def _bare_encoder(bert: Path, out: Path) -> Path:
    """``bert``'s encoder with a pooler and no LM head, like MiniLM, and its tokenizer."""
    import shutil

    from transformers import BertModel

    BertModel.from_pretrained(str(bert)).save_pretrained(str(out))
    for f in bert.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".json")) or f.name.startswith(("tokenizer",
                                                                                                "special")):
            shutil.copy(f, out / f.name)
    return out


@pytest.mark.slow
def test_train_weights_follow_an_encoder_cache_without_logits(tiny_bert: Path, data: Path, tmp_path: Path) -> None:
    cache, student, run = tmp_path / "cache", tmp_path / "student", tmp_path / "run"
    encoder = _bare_encoder(tiny_bert, tmp_path / "minilm-like")  # no LM head: a cache without logits
    done = _kdcache("precompute", "--teacher", str(encoder), "--data", str(data), "--out", str(cache),
                    "--layers", "0,2", "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    # A masked-LM student of the same tokenizer: it has an LM head, and is an encoder.
    assert _kdcache("init-student", "--teacher", str(tiny_bert), "--layers", "2", "--out",
                    str(student)).returncode == 0
    proc = _kdcache("train", "--cache", str(cache), "--student", str(student), "--out", str(run), "--max-steps",
                    "2", "--batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = proc.stderr.splitlines()[:3]
    assert any("--beta 0: the cache holds no logits" in line for line in first), first
    assert any("--alpha 0: an encoder's CE on unmasked cached tokens is near-trivial" in line for line in first), first
    written = json.loads((run / "options.json").read_text())  # the weights the run used, resolved
    assert (written["alpha"], written["beta"]) == (0.0, 0.0)
    assert os.path.isfile(run / "student" / "config.json")


def test_the_loss_plot_legends_sit_below_their_curves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kdcache.pipeline import report_plots as report

    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, out, title: figures.append(fig) or out)
    metrics = [{"step": s, "loss": 5.0 / s, "hidden": 2.0 / s, "hidden/s1_t2": 1.0 / s, "hidden/s2_t4": 1.0 / s}
               for s in range(1, 30)]
    report.plot_losses(metrics, tmp_path / "losses.png", "run: loss terms")
    (fig,) = figures
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), ax.get_title()


def test_only_loss_panels_are_labelled_as_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kdcache.pipeline import report_plots as report

    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, out, title: figures.append(fig) or out)
    metrics = [{"step": s, "loss": 1.0 / s, "tokens": 512, "aligned_share": 0.4} for s in range(1, 5)]
    report.plot_losses(metrics, tmp_path / "losses.png", "run")
    labels = {ax.get_title(): ax.get_ylabel() for ax in figures[0].axes if ax.get_title()}
    assert labels == {"loss": "loss value", "tokens": "valid tokens since the previous log",
                      "aligned_share": "teacher tokens aligned one to one (share)"}


@pytest.mark.slow
def test_the_baseline_scored_before_training_has_its_cka_on_the_map(tiny_gpt2: Path, data: Path,
                                                                   tmp_path: Path) -> None:
    cache, student, run = tmp_path / "heldout", tmp_path / "student", tmp_path / "run"
    assert _kdcache("precompute", "--teacher", str(tiny_gpt2), "--data", str(data), "--out", str(cache),
                    "--layers", "all", "--features", "hidden", "--no-progress").returncode == 0
    assert _kdcache("init-student", "--teacher", str(tiny_gpt2), "--layers", "1,3", "--out",
                    str(student)).returncode == 0
    proc = _kdcache("eval", "--cache", str(cache), "--run", str(run), "--student", str(student))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (written,) = list((run / "evals").glob("baseline@*.json"))
    cka = json.loads(written.read_text())["cka"]
    assert cka["mean_on_map"] is not None and [(p["student"], p["teacher"]) for p in cka["on_map"]] == [(1, 1),
                                                                                                        (2, 3)]
