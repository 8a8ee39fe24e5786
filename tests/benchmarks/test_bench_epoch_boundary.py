"""``benchmarks/bench_epoch_boundary.py`` at its smallest, so the benchmark behind RESULTS.md's epoch-boundary
figures never rots: three epochs stream, every boundary is measured, and shards held across it are reused."""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_epoch_boundary import build_cache, stream_once, summarise


def test_the_epoch_boundary_benchmark_at_its_smallest(tmp_path: Path) -> None:
    cache = build_cache(tmp_path / "cache", shards=4, per_shard=4, tokens=16, width=32)
    run = stream_once(cache, epochs=3, batch=2, step=0.001)
    assert run["epochs"] == [e for e in range(3) for _ in range(8)] and run["steps"] == 8
    result = summarise(run, window=2)
    assert result["boundary_vs_mid"] > 0 and result["boundary_wait_s"] >= 0
    assert result["shards_x_epochs"] == 12
    assert 4 <= result["decodes"] < 12  # one shuffle block: shards held at a boundary are not decoded again
