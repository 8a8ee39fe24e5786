"""Stage two's process group on the CPU builds no DeepSpeed op, and a JIT build's lock that outlived its builder is
reported with its path and the fix (torch would wait on it forever, silently)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdcache.stages.train.engine import STALE_LOCK_S, EngineConfigError, check_build_locks


def test_the_cpu_process_group_builds_no_shared_memory_op(tmp_path: Path) -> None:
    """A fresh environment's first init_distributed on the CPU: nothing JIT-built into the extensions folder."""
    code = ("from kdcache.stages.train.engine import init_distributed; import torch.distributed as d; "
            "info = init_distributed(); print('WORLD', info.world_size, d.get_backend())")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "ext")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "WORLD 1 gloo" in proc.stdout
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").iterdir())


def _lock(root: Path, op: str, age_s: float) -> Path:
    lock = root / "py311_cpu" / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def test_a_stale_build_lock_is_refused_with_its_path(tmp_path: Path) -> None:
    lock = _lock(tmp_path, "deepspeed_shm_comm", STALE_LOCK_S + 120)
    with pytest.raises(EngineConfigError) as err:
        check_build_locks(tmp_path)
    assert str(lock) in str(err.value) and f"rm {lock}" in str(err.value) and "deepspeed_shm_comm" in str(err.value)


def test_a_build_in_progress_or_another_project_s_lock_is_left_alone(tmp_path: Path) -> None:
    """A lock younger than a build takes (another process building the op now) is not an error, and neither is an
    old lock of an extension DeepSpeed does not build (training would never wait on it)."""
    _lock(tmp_path, "cpu_adam", 30)
    _lock(tmp_path, "someone_elses_kernels", STALE_LOCK_S * 10)
    check_build_locks(tmp_path)
    check_build_locks(tmp_path / "absent")  # no extensions folder yet
