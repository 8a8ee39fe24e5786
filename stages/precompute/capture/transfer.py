"""Device → host transfer of one batch's targets without the forward pass ever waiting on the host.

On a GPU the batch's targets are first reduced on the device: padding is dropped by one gather per array (the
index comes from the host's known lengths, so building it needs no sync), which leaves flat ``[T, ...]`` tensors
of valid tokens only. They are then copied on a side CUDA stream into pinned host memory, from PyTorch's caching
host allocator (freed blocks are reused once the host is done with them), and an event marks the copy's end.
The host waits on that event only when it needs the values: the caller resolves batch ``i`` after it has queued
batch ``i + 1``'s forward, so the device always has work (``stream.stream_shards``).

On the CPU there is nothing to copy: the padded arrays are handed over as they are, and each sequence is a view
that cuts its padding off; the writer's concatenation into the shard's flat arrays is then the one copy, as it is
after a GPU's. ``HostCopier(..., gather=True)`` runs the GPU's gather on the CPU, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kdcache.storage import BufferPool, Lease, ragged_streams


def valid_rows(lengths: list[int], padded_length: int, device: torch.device) -> torch.Tensor:
    """Flat row numbers of the valid tokens of a right-padded ``[B, L]`` batch (``lengths``: the B valid ones;
    ``padded_length``: L), batch-major: ``[T]`` int64, ``T = sum(lengths)``, row ``b * L + t`` for every
    ``t < lengths[b]``; on ``device``, copied from pinned memory without blocking: no wait for the device."""
    flat = [np.arange(n, dtype=np.int64) + b * padded_length for b, n in enumerate(lengths)]
    index = torch.from_numpy(np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64))
    if device.type != "cuda":
        return index.to(device)
    return index.pin_memory().to(device, non_blocking=True)


def cut_padding(arrays: dict[str, np.ndarray], i: int, lengths: dict[str, int]) -> dict[str, np.ndarray]:
    """Sequence ``i``'s valid part of every padded ``[B, ...]`` array (token rows ``[B, L, ...]``, attention maps
    ``[B, H, L_q, L_k]``), as views (the writer copies once); ``lengths``: its valid length in each token stream
    (``{"": L}``, or ``encoder`` and ``decoder``)."""
    streams = list(lengths)
    item = {}
    for name, value in arrays.items():
        dims = [lengths[s] for s in ragged_streams(name, streams)]
        item[name] = value[i, :, :dims[0], :dims[1]] if len(dims) == 2 else value[i, :dims[0]]
    return item


def gather_valid(arrays: dict[str, torch.Tensor], lengths: list[int]) -> tuple[dict[str, torch.Tensor],
                                                                             dict[str, int]]:
    """Drop the padding of a batch's targets where they are (the device): token rows ``[B, L, ...]`` -> ``[T, ...]``
    by one gather, attention maps ``[B, H, L, L]`` -> each sequence's ``[H, L_b, L_b]`` block, flattened and joined.

    Returns:
        the flat tensors, and the attention maps' names with their head counts.
    """
    flats, maps = {}, {}
    index = None
    for name, value in arrays.items():
        if len(ragged_streams(name, [""])) == 2:  # [B, H, L, L]: ragged by L^2
            maps[name] = value.shape[1]
            flats[name] = torch.cat([value[b, :, :n, :n].reshape(-1) for b, n in enumerate(lengths)])
            continue
        if index is None:  # the host knows the lengths: nothing waits for the device
            index = valid_rows(lengths, value.shape[1], value.device)
        flats[name] = value.flatten(0, 1).index_select(0, index)
    return flats, maps


class ShardItems(list[dict[str, np.ndarray]]):
    """Per-sequence target dicts (a list, in order), plus the float targets the device found finite in all of them:
    storage skips its own host-side pass over those (``CacheWriter.write_shard``'s ``finite``), the host time
    spent taking them in (the run summary's ``take_seconds``), and the leases of the reused buffers the arrays are
    views of (``release`` once the shard is written: the next batches' copies reuse them)."""

    def __init__(self, items: list[dict[str, np.ndarray]] = (), *, finite: frozenset[str] = frozenset(),  # type: ignore[assignment]
                 host_seconds: float = 0.0, leases: list[Lease] | None = None) -> None:
        super().__init__(items)
        self.finite = finite
        self.host_seconds = host_seconds  # the host's work taking the batch in, after the device's copy landed
        self.leases = leases or []

    def release(self) -> None:
        """Hand the buffers back; the items' arrays must not be read again."""
        for lease in self.leases:
            lease.release()
        self.leases = []


@dataclass
class HostBatch:
    """One batch's targets on their way to (or arrived on) the host, padding already removed.

    Attributes:
        lengths: ``[B]`` valid tokens per sequence, batch order.
        tensors: name -> host tensor (on a GPU pinned, and filled once ``event`` is done).
        arrays: name -> host array, set by ``ready``: flat after a gather (token rows ``[T, ...]``, the
            sequences one after the other; attention maps ``[sum_b H * L_b * L_b]``, each sequence's
            ``[H, L_b, L_b]`` block flattened), else still padded (``[B, L, ...]``, attention ``[B, H, L, L]``).
        maps: after a gather, the attention arrays' names -> their heads H.
        padded: whether the arrays are still padded.
        range_names: the targets whose largest |value| ``range_values`` holds, for the fp16 range check.
        range_values: ``[len(range_names)]`` float host tensor (None without such targets).
        event: marks the end of the device -> host copy (None on the CPU).
        pinned: the copy has landed and the tensors are still the pinned ones.
        pool: where the copies out of pinned memory go (the copier's); None: new memory each time.
        lease: the buffers of this batch's copies out of pinned memory (set by ``ready``).
    """

    lengths: np.ndarray
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    maps: dict[str, int] = field(default_factory=dict)
    padded: bool = False
    range_names: list[str] = field(default_factory=list)
    range_values: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    pinned: bool = False
    pool: BufferPool | None = None
    lease: Lease | None = None

    def ready(self) -> None:
        """Block until the device -> host copy is done, then take the arrays in.

        Pinned memory is moved into ordinary memory at once (one parallel copy, ``torch``'s intra-op threads), so
        the pinned blocks go back to the caching host allocator for the next batches: pinned memory in flight stays
        at about two batches, however many shards wait for the writers (allocating pinned memory anew for every
        batch ran at about 1.5 GB/s on the H200's host, slower than the disk). The ordinary memory comes from the
        copier's pool (``lease``), handed back once the shard holding these arrays is written.
        """
        self.wait()
        if self.pinned:
            self.lease = Lease(self.pool) if self.pool is not None else None
            self.tensors = {name: _pageable(t, self.lease) for name, t in self.tensors.items()}
            self.pinned = False
        if self.tensors:
            self.arrays = {name: as_numpy(t) for name, t in self.tensors.items()}
            self.tensors = {}

    def wait(self) -> None:
        """Block until the device -> host copy is done (at once on the CPU)."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None
            self.pinned = True

    def maxima(self) -> dict[str, float]:
        """Each range-checked target's largest |value| (NaN when it holds a NaN)."""
        self.ready()
        if self.range_values is None:
            return {}
        return dict(zip(self.range_names, self.range_values.float().tolist()))

    def split(self) -> list[dict[str, np.ndarray]]:
        """Per-sequence dicts of views into the flat arrays: ``[L_i, ...]``, attention ``[H, L_i, L_i]``."""
        self.ready()
        lengths = self.lengths.tolist()
        if self.padded:
            return [cut_padding(self.arrays, i, {"": n}) for i, n in enumerate(lengths)]
        token_edges = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        items: list[dict[str, np.ndarray]] = [{} for _ in lengths]
        for name, flat in self.arrays.items():
            heads = self.maps.get(name)
            edges = token_edges if heads is None else np.concatenate(
                [[0], np.cumsum([heads * n * n for n in lengths])]).tolist()
            for i, n in enumerate(lengths):
                part = flat[edges[i]:edges[i + 1]]
                items[i][name] = part if heads is None else part.reshape(heads, n, n)
        return items


class HostCopier:
    """Copies flat device tensors into host memory, on a side stream into pinned buffers where there is CUDA.

    Args:
        device: the teacher's device.
        gather: drop the padding before the copy (``gather_valid``); default: on a GPU, where it saves the copy
            of the padding, and not on the CPU, where there is no copy to save.
    """

    def __init__(self, device: torch.device, gather: bool | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.gather = self.cuda if gather is None else gather
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # Pageable memory for the copies out of pinned memory, reused batch after batch: fresh memory costs its
        # page faults on the helper thread (about 270 MB a batch for four d = 2,048 layers) and a free under the GIL.
        self.buffers = BufferPool() if self.cuda else None

    def start(self, arrays: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor],
              lengths: list[int]) -> HostBatch:
        """Queue the copies of a batch's padded ``arrays`` (after the gather, if on) and of the stacked ``maxima``
        (0-d tensors), and return the batch that will hold them; nothing here waits for the device."""
        flats, maps = gather_valid(arrays, lengths) if self.gather else (arrays, {})
        names = list(maxima)
        tensors = dict(flats)
        if names:
            tensors[" maxima"] = torch.stack([maxima[n] for n in names])
        host = self._copy(tensors)
        maxima_host = host.pop(" maxima", None)
        batch = HostBatch(np.asarray(lengths, dtype=np.int64), host, {}, maps, not self.gather, names, maxima_host,
                          pool=self.buffers)
        if self.cuda:
            batch.event = torch.cuda.Event()
            batch.event.record(self.stream)
        return batch

    def _copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors``. On CUDA the device tensors are recorded on the side stream, so the caching
        allocator does not hand their memory to the next forward before the copy has read it."""
        if self.stream is None:
            return {name: t.detach() for name, t in tensors.items()}
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        out = {}
        with torch.cuda.stream(self.stream):
            for name, tensor in tensors.items():
                tensor.record_stream(self.stream)
                out[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                out[name].copy_(tensor, non_blocking=True)
        return out


def _pageable(pinned: torch.Tensor, lease: Lease | None = None) -> torch.Tensor:
    """A copy of a pinned host tensor in ordinary (pageable) memory: in a buffer of ``lease`` where its dtype has a
    numpy twin (every stored dtype; bf16 travels as int16), else new memory."""
    try:
        dtype = torch.empty((), dtype=pinned.dtype).numpy().dtype
    except TypeError:  # bfloat16 and other types numpy lacks
        dtype = None
    if lease is None or dtype is None:
        out = torch.empty(pinned.shape, dtype=pinned.dtype)
    else:
        out = torch.from_numpy(lease.empty(tuple(pinned.shape), dtype))
    return out.copy_(pinned)


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A host tensor as numpy without a copy; int16 bf16 bits come back as uint16, the storage form."""
    array = tensor.numpy()
    return array.view(np.uint16) if tensor.dtype == torch.int16 else array
