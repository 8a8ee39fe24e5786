"""Caches in object storage, against a real S3-compatible server on 127.0.0.1 (moto's, through s3fs): the same
bytes as a local cache, checksums caught on read and verify, resume after a writer died, leases, bad URLs."""

from __future__ import annotations

import json
import os
import socket
import time

import numpy as np
import pytest

from kdcache.pipeline.cli import main
from kdcache.storage import CacheReader, CacheSpec, CacheWriter, encode_shard, verify_cache
from kdcache.storage.core.errors import CacheLockedError, ChecksumError, PartialCacheError, StorageError
from kdcache.storage.core.files import joined
from kdcache.storage.core.stores import RemoteStore, open_store
from kdcache.storage.writer import merge_parts
from tests.helpers.cache_files import cache_files
from tests.storage._cache_data import FINGERPRINTS, make_sequences
from tests.storage._integrity_suite import add_folders

BACKENDS = ["zarr", "arrow"]


def _spec(backend: str) -> CacheSpec:
    return CacheSpec(num_sequences=7, backend=backend, hidden_layers=(0, 2), attention_layers=(1,), logits="topk",
                     top_k=5, vocab_size=300, sequences_per_shard=3)


def _write(where, spec: CacheSpec, seqs, shards=None, finalize=True) -> None:
    with CacheWriter(where, spec, FINGERPRINTS) as writer:
        for k in range(spec.num_shards) if shards is None else shards:
            writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
        if finalize:
            writer.finalize()


def _tables(where) -> list[dict]:
    return [r.extra["files"] for r in CacheReader(where).records]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bucket_holds_the_same_cache_as_a_folder(backend, s3_bucket, tmp_path):
    spec = _spec(backend)
    seqs = make_sequences(spec, [(i % 6) + 1 for i in range(7)])
    url = f"{s3_bucket}/caches/run1"
    _write(url, spec, seqs)
    _write(tmp_path / "local", spec, seqs)
    assert _tables(url) == _tables(tmp_path / "local")  # byte for byte, file for file
    remote, local = CacheReader(url, decode_threads=2), CacheReader(tmp_path / "local")
    for k in range(spec.num_shards):
        a, b = remote.read_shard(k), local.read_shard(k)
        for name in a.arrays:
            np.testing.assert_array_equal(a.arrays[name], b.arrays[name], err_msg=name)
    for i in (0, 4, 6):
        for name, value in local[i].items():
            np.testing.assert_array_equal(remote[i][name], value, err_msg=name)
    assert verify_cache(url).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_corrupted_object_is_caught(backend, s3_bucket):
    spec = _spec(backend)
    url = f"{s3_bucket}/cache"
    _write(url, spec, make_sequences(spec, [6] * 7))
    store = open_store(url)
    key = "shards/shard-000001.arrow" if backend == "arrow" else "shards/shard-000001/hidden/2/c.0.0"
    data = bytearray(store.read(key))
    data[len(data) // 3] ^= 0x08
    store.put(key, bytes(data))
    report = verify_cache(url)
    assert not report.ok and {p.shard for p in report.problems} == {1}
    assert backend == "arrow" or (1, "hidden/2") in report.bad_arrays
    with pytest.raises(ChecksumError) as caught:
        CacheReader(url).read_shard(1)
    assert caught.value.shard == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_after_a_writer_died_mid_shard(backend, s3_bucket, tmp_path):
    spec = _spec(backend)
    seqs = make_sequences(spec, [4] * 7)
    url = f"{s3_bucket}/cache"
    _write(url, spec, seqs, shards=[0, 2], finalize=False)
    with CacheWriter(url, spec, FINGERPRINTS) as writer:  # died after PUTting half of shard 1, before its sidecar
        packed = writer.backend.pack(encode_shard(spec, 1, seqs[3:6]).arrays, spec, 1)
        half = {path: joined(data)[: len(joined(data)) // 2] for path, data in packed.files.items()}
        writer.store.put_shard(writer.backend.shard_key(1), half)
    with pytest.raises(PartialCacheError):
        CacheReader(url)  # still "writing": refused
    with CacheWriter(url, spec, FINGERPRINTS) as resumed:
        assert resumed.committed_shards() == {0, 2}
        resumed.write_shard(1, seqs[3:6])
        assert resumed.finalize().status == "complete"
    _write(tmp_path / "whole", spec, seqs)
    assert _tables(url) == _tables(tmp_path / "whole") and verify_cache(url).ok


def test_two_writers_of_one_part_and_a_stale_lease(s3_bucket):
    spec = _spec("zarr")
    url = f"{s3_bucket}/cache"
    first = CacheWriter(url, spec, FINGERPRINTS)
    with pytest.raises(CacheLockedError, match=r"part 0 of 1 .* held by a running writer"):
        CacheWriter(url, spec, FINGERPRINTS)
    first.close()
    CacheWriter(url, spec, FINGERPRINTS).close()  # released: the next writer gets it
    store = open_store(url)
    second = CacheWriter(url, spec, FINGERPRINTS)
    assert store.exists("locks/part-00000-of-00001.lock")  # the lease this test forges next
    second.close()
    # Renewed just now, so only the dead process (same host, no such pid) makes it stale.
    lease = {"owner": "dead", "host": socket.gethostname(), "pid": 2 ** 22 + 12345,
             "time": time.time()}
    store.put("locks/part-00000-of-00001.lock", json.dumps(lease).encode())
    CacheWriter(url, spec, FINGERPRINTS).close()  # that writer's process is gone: its lease is taken over
    store.put("locks/part-00000-of-00001.lock", b"[]")  # not a lease this code wrote: taken over, no traceback
    CacheWriter(url, spec, FINGERPRINTS).close()


def test_bad_urls_get_one_clear_line(s3_server, s3_bucket, capsys):
    cases = {
        "nosuchscheme://bucket/cache": "unknown storage scheme",
        "gs://bucket/cache": "needs gcsfs",
        "s3://no-such-bucket-kdcache/cache": "bucket 'no-such-bucket-kdcache' does not exist",
    }
    for url, message in cases.items():
        assert main(["inspect", url]) == 2
        err = capsys.readouterr().err
        assert message in err and url.split("/cache")[0] in err and "Traceback" not in err, err
        assert err.count("\n") == 1, err
    closed = f"endpoint_url=http://127.0.0.1:{_closed_port()}"
    retries = 'config_kwargs={"retries": {"max_attempts": 1}, "connect_timeout": 1}'
    try:
        assert main(["verify", f"{s3_bucket}/cache", "--storage-option", closed, "--storage-option", retries]) == 2
    finally:
        os.environ.pop("KDCACHE_STORAGE_OPTIONS", None)  # the CLI sets it for the processes it starts
    err = capsys.readouterr().err
    assert "cannot reach the store" in err and "endpoint" in err and "Traceback" not in err, err
    with pytest.raises(StorageError, match="does not exist"):
        CacheWriter("s3://no-such-bucket-kdcache/cache", _spec("zarr"), FINGERPRINTS)
    assert isinstance(open_store(f"{s3_bucket}/x"), RemoteStore)


def test_wrong_credentials_get_one_clear_line(s3_server, capsys):
    from tests.helpers.s3_server import free_port, start_server

    port = free_port()
    strict = start_server(port, check_credentials=True)
    try:
        code = main(["inspect", "s3://any-bucket/cache", "--storage-option", f"endpoint_url=http://127.0.0.1:{port}"])
    finally:
        os.environ.pop("KDCACHE_STORAGE_OPTIONS", None)
        strict.terminate()
        strict.wait(timeout=10)
    err = capsys.readouterr().err
    assert code == 2 and "access denied" in err and "credentials" in err and "Traceback" not in err, err
    assert err.count("\n") == 1


def _closed_port() -> int:
    from tests.helpers.s3_server import free_port

    return free_port()


_KILLED_WRITER = """
import sys, time
from kdcache.storage import CacheWriter
from tests.storage.test_object_store import _identical_inputs
from tests.storage._cache_data import FINGERPRINTS
spec, seqs = _identical_inputs(sys.argv[2])
with CacheWriter(sys.argv[1], spec, FINGERPRINTS) as writer:
    for k in range(spec.num_shards):
        writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
        time.sleep(0.5)  # the parent kills this process between shards or mid-shard
"""


def _identical_inputs(backend: str) -> tuple[CacheSpec, list]:
    spec = CacheSpec(num_sequences=16, backend=backend, hidden_layers=(0, 2), attention_layers=(1,), logits="topk",
                     top_k=5, vocab_size=300, sequences_per_shard=2, token_arrays=("loss_mask",))
    return spec, make_sequences(spec, [(i % 7) + 2 for i in range(16)])


def _with_folders(where, scratch) -> None:
    """A tokenizer and a teacher head beside the shards, then the manifest merged again to list them."""
    add_folders(where, scratch)
    merge_parts(where)


def _kill_then_resume(where, backend: str) -> None:
    """A writer process killed with SIGKILL after two committed shards, then a new writer finishing the cache."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(where), backend], cwd=repo,
                            env={**os.environ, "PYTHONPATH": str(repo)}, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if sum(n.endswith(".json") for n in open_store(where).list("shards")) >= 2:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    spec, seqs = _identical_inputs(backend)
    with CacheWriter(where, spec, FINGERPRINTS) as writer:
        for k in sorted(set(range(spec.num_shards)) - writer.committed_shards()):
            writer.write_shard(k, seqs[slice(*spec.shard_range(k))])
        assert writer.finalize().status == "complete"


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_uninterrupted_resumed_and_bucket_caches_are_byte_identical(backend, s3_bucket, tmp_path):
    spec, seqs = _identical_inputs(backend)
    _write(tmp_path / "whole", spec, seqs)
    _kill_then_resume(tmp_path / "resumed", backend)
    url = f"{s3_bucket}/cache"
    _write(url, spec, seqs, shards=list(reversed(range(spec.num_shards))))  # another order of commits
    for n, where in enumerate((tmp_path / "whole", tmp_path / "resumed", url)):
        _with_folders(where, tmp_path / f"scratch{n}")
    whole = cache_files(tmp_path / "whole")
    assert len(whole) >= 2 * spec.num_shards + 4 and "shards/shard-000001.json" in whole
    assert "teacher_head/head.safetensors" in whole and "tokenizer/.kdcache-files.json" in whole
    for other in (tmp_path / "resumed", url):
        assert cache_files(other) == whole, other  # every data file, sidecar and folder file, byte for byte
        assert verify_cache(other).ok
    # The manifests differ only in what names the run: its times, and the crc32c that covers them.
    manifests = [json.loads(open_store(w).read("manifest.json")) for w in (tmp_path / "whole", tmp_path / "resumed",
                                                                            url)]
    for manifest in manifests:
        for key in ("created_at", "updated_at", "crc32c"):
            manifest.pop(key)
    assert manifests[0] == manifests[1] == manifests[2]
