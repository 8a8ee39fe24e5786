"""A real S3-compatible server on 127.0.0.1 for the tests: moto's standalone server (``moto[server]``), which
s3fs runs its own tests against. No mocks: kdcache talks to it through s3fs over HTTP, as it would to S3.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kdcache-test", "AWS_SECRET_ACCESS_KEY": "kdcache-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(port: int, timeout: float = 30.0, *, check_credentials: bool = False) -> subprocess.Popen:
    """Start ``python -m moto.server`` on ``port`` and wait until it answers.

    ``check_credentials``: every request must be signed with keys moto's IAM knows (none are created, so any
    key is refused with 403, as S3 refuses wrong credentials).
    """
    env = {**os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if check_credentials else {})}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("moto server exited at start") from None
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"moto server did not answer on port {port} within {timeout} s")


def s3_environment(port: int) -> dict[str, str]:
    """What a client needs to reach the server: endpoint and (dummy) credentials, as a user sets them."""
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", **CREDENTIALS}


def serve(port: int | None = None) -> Iterator[str]:
    """Run a server for the duration of a ``yield``, with the environment pointing at it; yields its endpoint."""
    port = port or free_port()
    proc = start_server(port)
    saved = {key: os.environ.get(key) for key in s3_environment(port)}
    os.environ.update(s3_environment(port))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        proc.terminate()
        proc.wait(timeout=10)


def make_bucket(name: str) -> str:
    """Create bucket ``name`` on the server the environment points at; returns ``s3://name``."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir(name)
    return f"s3://{name}"
