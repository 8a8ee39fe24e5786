"""The device feed prepares batch i+1 before step i uses batch i (on a GPU; on the CPU as it is handed over), keeps the
order and counts the reader's wait."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kdcache.stages.train.feed.device_feed import DeviceFeed


def test_the_next_batch_is_prepared_before_the_step_uses_this_one() -> None:
    events: list[tuple[str, int]] = []

    def prepare(batch: dict) -> dict:
        events.append(("prepare", batch["i"]))
        return {"i": batch["i"], "x": batch["x"] * 2}

    host = [{"i": i, "x": torch.full((2,), float(i))} for i in range(3)]
    got = []
    for batch in DeviceFeed(host, prepare, torch.device("cpu"), ahead=True):  # the GPU's order, on the CPU
        events.append(("use", batch["i"]))
        got.append(batch["x"].tolist())
    assert got == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    assert events == [("prepare", 0), ("prepare", 1), ("use", 0), ("prepare", 2), ("use", 1), ("use", 2)]


def test_on_the_cpu_each_batch_is_prepared_as_it_is_handed_over() -> None:
    """No side stream, nothing to overlap: holding batch i+1 during step i would only hold one more batch."""
    events: list[tuple[str, int]] = []
    host = [{"i": i} for i in range(3)]
    for batch in DeviceFeed(host, lambda b: events.append(("prepare", b["i"])) or b, torch.device("cpu")):
        events.append(("use", batch["i"]))
    assert events == [("prepare", 0), ("use", 0), ("prepare", 1), ("use", 1), ("prepare", 2), ("use", 2)]


def test_an_empty_stream_yields_nothing_and_the_readers_wait_is_counted() -> None:
    assert list(DeviceFeed([], dict, torch.device("cpu"))) == []

    def slow() -> Iterator[dict]:
        for i in range(2):
            time.sleep(0.05)
            yield {"i": i}

    feed = DeviceFeed(slow(), dict, torch.device("cpu"))
    assert [b["i"] for b in feed] == [0, 1]
    assert feed.waited >= 0.09


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream exists on CUDA only")
def test_on_a_gpu_the_batches_arrive_whole_through_the_side_stream() -> None:
    device = torch.device("cuda")
    host = [{"x": torch.full((1 << 22,), float(i), dtype=torch.float16).pin_memory()} for i in range(4)]
    feed = DeviceFeed(host, lambda b: {"x": b["x"].to(device, non_blocking=True).float()}, device)
    for i, batch in enumerate(feed):
        slow = torch.randn(2048, 2048, device=device) @ torch.randn(2048, 2048, device=device)  # the "step"
        assert torch.equal(batch["x"], torch.full((1 << 22,), float(i), device=device)) and slow.isfinite().all()
