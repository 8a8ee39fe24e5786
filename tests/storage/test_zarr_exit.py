"""zarr's exit handler raised ``RuntimeError: Cannot close a running event loop`` after a finished precompute on a
loaded machine (issue 61): it waits only 0.2 s for its IO thread to stop before closing the loop. kdcache stops that
loop and waits for the thread first (``storage.backends.zarr_backend.stop_zarr_io``).

The child process writes a zarr cache (which starts zarr's IO loop), then keeps that loop busy for a second as it
exits: the IO thread cannot stop within zarr's 0.2 s, as on a machine whose cores are all taken.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
from kdcache.storage import CacheSpec, CacheWriter
from tests.storage._cache_data import FINGERPRINTS, make_sequences
spec = CacheSpec(num_sequences=2, backend="zarr", hidden_layers=(0,), attention_layers=(), logits=None,
                 vocab_size=300, sequences_per_shard=2)
with CacheWriter(sys.argv[1], spec, FINGERPRINTS) as writer:
    writer.write_shard(0, make_sequences(spec, [5, 3]))
    writer.finalize()
from zarr.core import sync
assert sync.iothread[0] is not None and sync.iothread[0].is_alive()  # writing started zarr's IO loop
sync.loop[0].call_soon_threadsafe(time.sleep, 1.0)  # the IO thread busy as the process exits
print("written")
"""


def test_a_finished_write_exits_without_zarrs_event_loop_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "cache")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "written", done.stderr
    assert "Cannot close a running event loop" not in done.stderr and "Traceback" not in done.stderr, done.stderr
