"""Both stages with the cache in object storage: a real S3-compatible server on 127.0.0.1 (moto's, via s3fs).

Precompute to ``s3://`` with both backends gives the same cache as a local folder; a writer killed with -9 and
rerun ends identical to an uninterrupted run; ZeRO-2 training from the bucket follows the same losses as from a
local copy; a sweep of two runs, with eval, reads the bucket too.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdcache.pipeline.cli import main
from kdcache.stages.train.logging import read_jsonl
from kdcache.storage import open_store, verify_cache
from tests.helpers.tiny_models import sample_texts, write_text_dataset
from tests.stages.precompute.test_precompute_resume import REPO, _argv, _env, _options, assert_same_cache
from tests.stages.train._train_support import make_student_config


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    return write_text_dataset(tmp_path / "data.jsonl", sample_texts(40, seed=11))


def _sidecars(url: str) -> int:
    return sum(name.endswith(".json") for name in open_store(url).list("shards"))


@pytest.mark.parametrize("backend", ["zarr", "arrow"])
def test_precompute_to_a_bucket_equals_a_local_cache(backend: str, tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                                     s3_bucket: str) -> None:
    url, local = f"{s3_bucket}/caches/gpt2", tmp_path / "local"
    assert main(_argv(_options(tiny_gpt2, corpus, url, format=backend))) == 0
    assert main(_argv(_options(tiny_gpt2, corpus, local, format=backend))) == 0
    assert_same_cache(local, url)
    assert verify_cache(url).ok and open_store(url).exists("tokenizer/tokenizer.json")
    assert main(["inspect", url]) == 0 and main(["merge", url]) == 0


@pytest.mark.slow
def test_kill_9_mid_precompute_to_a_bucket_then_rerun(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                                       s3_bucket: str) -> None:
    url, local = f"{s3_bucket}/killed", tmp_path / "reference"
    assert main(_argv(_options(tiny_gpt2, corpus, local))) == 0
    proc = subprocess.Popen([sys.executable, "-m", "kdcache", *_argv(_options(tiny_gpt2, corpus, url))], cwd=REPO,
                            env={**_env(), **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if _sidecars(url) >= 3:
            os.kill(proc.pid, signal.SIGKILL)  # mid-run: some shards committed, others in flight
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert 3 <= _sidecars(url) < 20
    assert main(_argv(_options(tiny_gpt2, corpus, url))) == 0  # the dead writer's lease is taken over
    assert_same_cache(local, url)
    assert verify_cache(url).ok


@pytest.mark.slow
def test_zero2_training_and_a_sweep_read_the_bucket(tiny_gpt2: Path, corpus: Path, tmp_path: Path,
                                                     s3_bucket: str) -> None:
    url, local = f"{s3_bucket}/cache", tmp_path / "cache"
    every_layer = {"layers": ("0", "1", "2", "3"), "attention_layers": ("1", "2", "3")}
    for out in (url, local):
        assert main(_argv(_options(tiny_gpt2, corpus, out, **every_layer))) == 0
    student = make_student_config(tmp_path / "student", tiny_gpt2, n_layer=2, n_embd=16, n_head=2)
    common = ["--student", str(student), "--zero-stage", "2", "--max-steps", "3", "--batch-size", "4",
              "--log-every", "1"]
    losses = {}
    for name, cache in (("bucket", url), ("folder", str(local))):
        assert main(["train", "--cache", cache, "--out", str(tmp_path / name), *common]) == 0
        losses[name] = [row["loss"] for row in read_jsonl(tmp_path / name / "metrics.jsonl")]
    assert len(losses["bucket"]) == 3 and losses["bucket"] == pytest.approx(losses["folder"], rel=1e-6)
    # The student folder has no tokenizer: the exported one is the cache's, fetched from the bucket.
    fetched = (tmp_path / "bucket" / "student" / "tokenizer.json").read_bytes()
    assert fetched == (tmp_path / "folder" / "student" / "tokenizer.json").read_bytes()
    assert all("data_wait_s" in row for row in read_jsonl(tmp_path / "bucket" / "metrics.jsonl"))
    sweep = tmp_path / "sweep"
    code = main(["sweep", "--cache", url, "--student", str(student), "--out", str(sweep), "--eval-cache", url,
                 "--grid", "layer_map=uniform,last", "--max-steps", "2", "--batch-size", "4", "--log-every", "1"])
    assert code == 0
    with open(sweep / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["status"] for r in rows] == ["ok", "ok"] and all(float(r["eval_perplexity"]) > 1 for r in rows)
    assert main(["report", str(sweep)]) == 0
