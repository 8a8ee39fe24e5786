"""Streaming cached teacher targets into training, in a deterministic, resumable order.

The order of an epoch is a pure function of (seed, epoch, the cache's shard ranges):

1. shuffle the shards;
2. concatenate their sequences and shuffle them in blocks of ``shuffle_block`` sequences, so one block touches
   only a few neighbouring shards (decoded once, kept while the block lasts).

Partition. Each epoch uses ``steps_per_epoch * world * batch`` sequences; the few left over at the end of the
shuffled order are **dropped** (a different few each epoch), so every rank runs the same number of steps and no
sequence is seen twice in an epoch. Rank ``r`` takes the ``r``-th contiguous span of the used order (its own
shards, mostly), cut into micro-batches ``k = 0, 1, ...``. DataLoader worker ``w`` of ``n`` builds the rank's
micro-batches with ``k % n == w``; PyTorch takes batches from workers round-robin, so the stream a rank sees does
not depend on the number of workers.

Resumption. A position is (epoch, global sample index): the number of the epoch's sequences consumed by all
ranks together, ``k * world * batch`` after ``k`` micro-steps. Resuming needs the same world size and batch size
(``check_resumable`` explains otherwise).

Speed. One producer thread assembles micro-batches in order while a thread pool decodes the shards the next
``prefetch`` micro-batches need, the next epoch's first ones included (``decode_plan``; ``reader.read_shard``
decodes only the arrays asked for; the codecs release the GIL). Float targets stay fp16 (or bf16 bits, as int16)
through collate; ``to_device`` makes them fp32 on the device, so the host never holds an fp32 copy (dense
``[B, L, V]`` teacher logits stay fp16 or bf16 there too: each chunk of the vocabulary pass widens its own rows).
Hidden states of a quantised codec (int8, fp8, int4) cross as their codes and fp16 scales and are decoded there
too (``stages.targets.hidden.device_codecs``). At most ``prefetch`` batches of ``prefetch_mib`` MiB in all wait for the
step (``ahead``), and dense teacher rows are read per batch, not kept with their decoded shard.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from kdcache.stages.targets.hidden.device_codecs import Projection, decode_batch, load_projection
from kdcache.stages.train.feed.ahead import PREFETCH_MIB, ByteQueue, batch_bytes
from kdcache.stages.train.feed.decode_plan import decode_plan, shard_locator
from kdcache.storage import (
    ArrayKind,
    CacheReader,
    HiddenCodec,
    KdcacheError,
    kind_of,
    part_of,
    prefixed,
    ragged_streams,
    split_stream,
    vocab_id_names,
    vocab_row_names,
)

# A batch: array name -> tensor ([B, L, ...] targets, [B, L] ids and masks, [B] sample ids), padded per token
# stream (``collate``), beside which the stream puts its position (``epoch``, ``step_in_epoch``: ints) and the
# loop its host record; on the host until ``to_device`` copies and decodes it. Defined here only.
Batch = dict[str, Any]
# Host arrays a run adds to every collated batch, in place, where the batch is made (the reader's thread or a
# DataLoader worker), so that work stays off the training step: e.g. a cross-tokenizer run's student tokens and
# spans. Picklable, for the workers.
BatchExtension = Callable[[Batch], None]


class StreamStateError(KdcacheError):
    """A stream that cannot be made as asked: a saved data position the current settings cannot resume, too few
    sequences for one step, or arrays without the ``input_ids`` their batches are padded to."""


def _input_streams(names: Sequence[str]) -> list[str]:
    """The token streams whose ``input_ids`` are among ``names``, in their order (``""``, or encoder then decoder)."""
    return [split_stream(n)[0] for n in names if kind_of(n) == ArrayKind.INPUT_IDS]


def _check_padding_names(names: Sequence[str]) -> None:
    """Each stream an array is padded along (``ragged_streams``: logits along the last, cross-attention along both)
    must be read with its ``input_ids``: ``collate`` pads to them and makes the stream's ``mask`` from them."""
    streams = _input_streams(names)
    needed = {s for n in names for s in (ragged_streams(n, streams) if streams else (split_stream(n)[0],))}
    missing = sorted(prefixed(s, "input_ids") for s in needed - set(streams))
    if missing:
        raise StreamStateError(f"names {list(names)} lack {missing}: a batch is padded to each stream's input_ids "
                               f"(its mask comes from them); add them to the names")


@dataclass(frozen=True)
class DataPosition:
    """Where the stream stands: ``sample_index`` sequences of epoch ``epoch`` consumed, over all ranks."""

    epoch: int = 0
    sample_index: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample_index": self.sample_index}


def epoch_order(shard_ranges: Sequence[tuple[int, int]], seed: int, epoch: int, shuffle_block: int) -> np.ndarray:
    """The global order of sequence ids for one epoch.

    Args:
        shard_ranges: ``(seq_start, seq_stop)`` per shard, as ``CacheReader.shard_ranges``.
        epoch: the epoch number (0-based).
        shuffle_block: sequences shuffled together after the shard shuffle.

    Returns:
        int64 array [N] holding every sequence id once.
    """
    rng = np.random.Generator(np.random.PCG64([seed, epoch]))
    shard_perm = rng.permutation(len(shard_ranges))
    parts = [np.arange(*shard_ranges[i], dtype=np.int64) for i in shard_perm]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    for start in range(0, len(ids), shuffle_block):
        rng.shuffle(ids[start:start + shuffle_block])  # in place on the view
    return ids


def steps_per_epoch(num_sequences: int, world_size: int, batch_size: int) -> int:
    """Micro-batches per rank per epoch (the tail that does not fill a step on every rank is dropped)."""
    return num_sequences // (world_size * batch_size)


def rank_batches(order: np.ndarray, rank: int, world_size: int, batch_size: int) -> list[np.ndarray]:
    """Rank ``rank``'s micro-batches of one epoch: its contiguous span of the used order, cut in batches."""
    n = steps_per_epoch(len(order), world_size, batch_size)
    span = order[rank * n * batch_size:(rank + 1) * n * batch_size]
    return [span[k * batch_size:(k + 1) * batch_size] for k in range(n)]


def next_position(epoch: int, step_in_epoch: int, world_size: int, batch_size: int, n_steps: int) -> DataPosition:
    """The position after micro-batch ``step_in_epoch`` of ``epoch`` has been consumed on every rank."""
    if step_in_epoch + 1 >= n_steps:
        return DataPosition(epoch + 1, 0)
    return DataPosition(epoch, (step_in_epoch + 1) * world_size * batch_size)


def resumable_state(position: DataPosition, world_size: int, batch_size: int, seed: int) -> dict[str, int]:
    """A checkpoint's data state, as ``check_resumable`` reads it back: the position and the settings that fix the
    order."""
    return {**position.to_dict(), "world_size": world_size, "batch_size": batch_size, "seed": seed}


def check_resumable(saved: dict[str, Any], world_size: int, batch_size: int, seed: int) -> DataPosition:
    """Turn a checkpoint's data state into a position, refusing settings that would change the order.

    Raises:
        StreamStateError: world size, batch size or seed differ from the checkpoint's.
    """
    problems = [f"{key} was {saved[key]} in the checkpoint, now {now}"
                for key, now in (("world_size", world_size), ("batch_size", batch_size), ("seed", seed))
                if key in saved and saved[key] != now]
    if problems:
        raise StreamStateError("cannot resume the data stream exactly: " + "; ".join(problems)
                               + ". Resume with the checkpoint's settings.")
    return DataPosition(int(saved["epoch"]), int(saved["sample_index"]))


def collate(sequences: list[dict[str, np.ndarray]], sample_ids: Sequence[int]) -> Batch:
    """Pad a list of cached sequences into one batch, keeping the stored dtypes; every token stream is padded
    on its own (one stream, or ``encoder`` and ``decoder``, see ``storage.core.streams``).

    Args:
        sequences: per sequence, each stream's ``input_ids [L]`` and any of ``hidden/{j} [L, d]``,
            ``attention/{j} [H', L, L]``, ``cross_attention/{j} [H', L_dec, L_enc]``, ``logits/full [L, V]``,
            ``logits/topk_values [L, k]``, ``logits/topk_ids [L, k]``, ``logits/lse [L]`` (names prefixed with
            the stream, e.g. ``encoder/hidden/2``, in a two-stream cache; logits are on the last stream).
        sample_ids: the global sequence ids, carried in the batch.

    Returns:
        Per stream ``input_ids`` [B, L] int64 (0 at padding) and ``mask`` [B, L] int64 (1 = real token), with the
        stream's prefix; ``sample_ids`` [B]; targets [B, L, ...] and attention [B, H', L_q, L_k], zero-padded.
        fp16 stays fp16; bf16 bits become int16 (torch has few uint16 kernels); ids become int64 for gather.
    """
    streams = _input_streams(list(sequences[0]))
    sizes = {s: max(len(q[prefixed(s, "input_ids")]) for q in sequences) for s in streams}
    out: Batch = {"sample_ids": torch.tensor(list(sample_ids), dtype=torch.int64)}
    for stream in streams:
        lengths = np.array([len(q[prefixed(stream, "input_ids")]) for q in sequences])
        mask = (np.arange(sizes[stream]) < lengths[:, None]).astype(np.int64)
        out[prefixed(stream, "mask")] = torch.from_numpy(mask)
    for name in sequences[0]:
        shape = [sizes[s] for s in ragged_streams(name, streams)]
        out[name] = torch.from_numpy(_pad_stack(name, [q[name] for q in sequences], shape))
    return out


def _pad_stack(name: str, arrays: list[np.ndarray], sizes: list[int]) -> np.ndarray:
    """Zero-pad ragged arrays to ``[B, ...]``: dim 0 is ragged (tokens), or dims 1 and 2 for attention maps
    (after the heads), to ``sizes``."""
    ragged = (1, 2) if len(sizes) == 2 else (0,)
    shape = list(arrays[0].shape)
    for dim, size in zip(ragged, sizes):
        shape[dim] = size
    dtype = _batch_dtype(name, arrays[0].dtype)
    out = np.zeros((len(arrays), *shape), dtype=dtype)
    for i, a in enumerate(arrays):
        rows: tuple[Any, ...] = (i, *(slice(0, n) for n in a.shape))
        bf16_bits = a.dtype == np.uint16 and dtype == np.int16  # uint16 ids are cast, bf16 bits reinterpreted
        out[rows] = a.view(dtype) if bf16_bits else a
    return out


def _read_rows(reader: CacheReader, name: str, ids: np.ndarray, batch: Batch) -> np.ndarray:
    """``[B, L, V]`` of array ``name`` for global sequences ``ids [B]``, zero-padded to the batch's length as
    ``collate`` pads, read one sequence's rows at a time straight into it: besides the batch, one sequence's."""
    out: np.ndarray | None = None
    for i, seq in enumerate(ids.tolist()):
        rows = reader.get(seq, [name])[name]  # [L_i, V] in the stored dtype
        if out is None:
            stream = ragged_streams(name, _input_streams(list(batch)))[0]  # logits: the last stream
            length = batch[prefixed(stream, "mask")].shape[1]
            out = np.zeros((len(ids), length, *rows.shape[1:]), dtype=_batch_dtype(name, rows.dtype))
        out[i, :len(rows)] = rows.view(out.dtype)  # bf16 bits reinterpreted as int16, as collate does
    assert out is not None, "a micro-batch holds at least one sequence"
    return out


# Integer arrays collated as int64 for gather and embedding lookups, never reinterpreted as bf16 bits.
_ID_KINDS = frozenset({ArrayKind.INPUT_IDS, ArrayKind.POSITION_IDS})


def _batch_dtype(name: str, stored: np.dtype) -> np.dtype:
    if kind_of(name) in _ID_KINDS or part_of(name) == "outlier_ids" or name in vocab_id_names():
        # never bf16 bits
        return np.dtype(np.int64)
    if stored == np.uint16:  # bf16 bits
        return np.dtype(np.int16)
    return stored


def to_device(batch: Batch, device: torch.device | str, hidden_codec: HiddenCodec | None = None,
              projection: Projection | None = None) -> Batch:
    """Copy a batch to ``device`` and only there turn targets into float32.

    int16 tensors are bf16 bits (see ``collate``); other floating tensors are fp16 or fp32. Dense teacher logits
    ``[B, L, V]`` (``storage.vocab_row_names``) keep their stored fp16 or bf16: the vocabulary pass gathers and
    widens each chunk's own rows, where a float32 copy of the batch would be 1 GiB at 8 x 256 tokens and V = 128k
    (issue 63). With the cache's ``hidden_codec`` (``spec.hidden_codec``), coded hidden states ``[B, L, d']``
    become float32 ``[B, L, d]`` there (through ``projection``'s bases for a rank codec,
    ``hidden_codecs.load_projection``).
    """
    out: Batch = {}
    stored = vocab_row_names()
    for name, value in batch.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        moved = value.to(device, non_blocking=True)
        bf16 = moved.view(torch.bfloat16) if moved.dtype == torch.int16 else moved
        out[name] = bf16 if split_stream(name)[1] in stored or not bf16.is_floating_point() else bf16.float()
    return out if hidden_codec is None else decode_batch(hidden_codec, out, projection)


READAHEAD_REMOTE = 2


class CacheStream(IterableDataset):
    """Micro-batches of cached targets for one rank, epoch after epoch, from a start position.

    Each item is a collated batch (see ``collate``) plus ``epoch`` and ``step_in_epoch`` (ints), so the loop can
    record the position reached. Use it with ``DataLoader(stream, batch_size=None, num_workers=...)``.
    """

    def __init__(self, cache: str | os.PathLike[str] | CacheReader, names: Sequence[str], *, batch_size: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1, start: DataPosition = DataPosition(),
                 epochs: int | None = None, shuffle_block: int = 256, prefetch: int = 4, decode_threads: int = 0,
                 allow_partial: bool = False, pin_memory: bool = False, extend: BatchExtension | None = None,
                 prefetch_mib: int = PREFETCH_MIB):
        """``cache`` is a cache folder or URL, or an open ``CacheReader``, which this process then reads through
        (a DataLoader worker opens its own from the reader's folder or URL); ``extend`` adds a run's own arrays
        to each batch as it is made; at most ``prefetch`` batches of about ``prefetch_mib`` MiB in all wait for
        the step (``ahead.ByteQueue``: one at a time when one is bigger)."""
        super().__init__()
        if isinstance(prefetch_mib, bool) or not isinstance(prefetch_mib, int) or prefetch_mib < 1:
            raise ValueError(f"prefetch_mib must be a whole number of MiB >= 1, got {prefetch_mib!r}")
        self.prefetch_bytes = prefetch_mib << 20
        self.names = tuple(names)
        _check_padding_names(self.names)
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.start, self.epochs = start, epochs
        self.shuffle_block, self.prefetch, self.decode_threads = shuffle_block, prefetch, decode_threads
        self.allow_partial, self.pin_memory, self.extend = allow_partial, pin_memory, extend
        self.cache = str(cache) if isinstance(cache, (str, os.PathLike)) else cache.root
        reader = self._open() if isinstance(cache, (str, os.PathLike)) else cache
        self._reader: CacheReader | None = reader
        self.hidden_codec = reader.spec.hidden_codec  # coded hidden states are decoded on the device
        self.projection = load_projection(reader)  # a rank codec's bases, for that decode
        # Only committed shards (all of them for a complete cache; some with --allow-partial).
        self.shard_ids = [int(k) for k in reader.committed_shards]
        self.shard_ranges = [reader.spec.shard_range(k) for k in self.shard_ids]
        self.num_sequences = sum(b - a for a, b in self.shard_ranges)
        self.steps_per_epoch = steps_per_epoch(self.num_sequences, world_size, batch_size)
        if self.steps_per_epoch == 0:
            raise StreamStateError(
                f"the cache holds {self.num_sequences} sequences, fewer than one step needs "
                f"({world_size} rank(s) x batch size {batch_size}); lower --batch-size")
        if start.sample_index % (world_size * batch_size):
            raise StreamStateError(f"sample index {start.sample_index} is not a multiple of world size x batch "
                                   f"size ({world_size} x {batch_size})")

    def _open(self) -> CacheReader:
        return CacheReader(self.cache, allow_partial=self.allow_partial, decode_threads=self.decode_threads or None)

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned DataLoader worker receives: no reader (it holds file handles, a lock and threads)."""
        return {**self.__dict__, "_reader": None}

    def to_device(self, batch: Batch, device: torch.device | str) -> Batch:
        """``batch`` on ``device`` with float32 targets, coded hidden states decoded there (as ``kdcache train``); dense
        teacher logits ``[B, L, V]`` keep their stored fp16 / bf16 (widen them yourself, a chunk at a time)."""
        return to_device(batch, device, self.hidden_codec, self.projection)

    def plan(self) -> Iterator[tuple[int, list[tuple[int, np.ndarray]]]]:
        """This rank's micro-batches from the start position on, grouped by epoch: (epoch, [(step, ids)])."""
        epoch, first = self.start.epoch, self.start.sample_index // (self.world_size * self.batch_size)
        while self.epochs is None or epoch < self.epochs:
            order = epoch_order(self.shard_ranges, self.seed, epoch, self.shuffle_block)
            batches = rank_batches(order, self.rank, self.world_size, self.batch_size)
            yield epoch, [(k, ids) for k, ids in enumerate(batches) if k >= first]
            epoch, first = epoch + 1, 0

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # A DataLoader worker opens its own reader: a forked one inherits this process's reader, whose decode
        # threads and locks did not come along.
        reader = self._reader if info is None and self._reader is not None else self._open()
        producer = _Producer(self, reader, self._worker_plan(worker, workers))
        try:
            yield from producer
        finally:
            producer.close()

    def _worker_plan(self, worker: int, workers: int) -> Iterator[tuple[int, list[tuple[int, np.ndarray]]]]:
        """Every ``workers``-th micro-batch of the rank's stream, counted from the start position."""
        seen = 0
        for epoch, items in self.plan():
            yield epoch, [item for i, item in enumerate(items, seen) if i % workers == worker]
            seen += len(items)


class _Producer:
    """Assembles ``stream``'s planned micro-batches (``plan``) in a background thread, reading through ``reader``;
    shards decode in a pool ahead of need."""

    _DONE = object()

    def __init__(self, stream: CacheStream, reader: CacheReader,
                 plan: Iterator[tuple[int, list[tuple[int, np.ndarray]]]]):
        # A coded hidden state travels with its scales (and outliers) to the device, where it is decoded.
        names = [p for n in stream.names for p in reader.spec.with_parts(n)]
        # Dense [L, V] teacher rows from a local zarr cache are read per batch, row ranges only (zarr decodes just
        # their chunks), not decoded with their whole shard and kept beside the batch: 501 MiB per 8 x 256 tokens at
        # V = 128k. Not where a read decodes the whole column anyway (Arrow: per-batch reads would decode it again
        # for every batch its handle was closed between), nor from an object store, whose file is fetched whole.
        apart = vocab_row_names() if reader.store.is_local and reader.reads_row_ranges else frozenset()
        self.rows_apart = [n for n in names if split_stream(n)[1] in apart]
        self.stream, self.reader, self.plan = stream, reader, plan
        self.names = [n for n in names if n not in self.rows_apart]
        # Shards read ahead of need beyond the prefetch window: none from a local disk (the page cache and a
        # few threads keep up), two from an object store, where a request costs milliseconds.
        self.readahead = 0 if reader.store.is_local else READAHEAD_REMOTE
        self.locate = shard_locator(stream.shard_ranges)
        self.pool = ThreadPoolExecutor(max(1, reader.decode_threads), thread_name_prefix="kdcache-decode")
        self.queue = ByteQueue(stream.prefetch, stream.prefetch_bytes)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kdcache-collate", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._produce()
            self._put(self._DONE)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(exc)

    def _produce(self) -> None:
        """Carry out ``decode_plan``: decodes queued ahead of need (across epoch boundaries too), batches
        assembled in order, each shard dropped after its last planned use."""
        decoded: dict[int, Future] = {}
        for planned in decode_plan(self.plan, self.locate, self.stream.prefetch, self.readahead):
            for s in planned.decode:
                decoded[s] = self.pool.submit(self.reader.read_shard, self.stream.shard_ids[s], self.names)
            if not self.queue.room(self.stop):  # the shards decode while the queued batches take their room
                return
            seqs = [decoded[int(s)].result().sequence(int(i)) for s, i in zip(planned.shards, planned.local)]
            batch = collate([{n: q[n] for n in self.names} for q in seqs], planned.ids.tolist())
            for name in self.rows_apart:
                batch[name] = torch.from_numpy(_read_rows(self.reader, name, planned.ids, batch))
            if self.stream.extend is not None:
                self.stream.extend(batch)
            if self.stream.pin_memory and torch.cuda.is_available():  # pinned: the copy to the GPU does not block
                batch = {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            batch.update(epoch=planned.epoch, step_in_epoch=planned.step)
            for s in planned.release:
                del decoded[s]
            self._put(batch)

    def _put(self, item: object) -> None:
        self.queue.put(item, batch_bytes(item) if isinstance(item, dict) else 0, self.stop)

    def __iter__(self) -> Iterator[Batch]:
        while True:
            item = self.queue.get()
            if item is self._DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield cast(Batch, item)  # the producer puts batches, _DONE and errors only

    def close(self) -> None:
        if sys.is_finalizing():  # a generator dropped at interpreter exit: threads are daemons, nothing to do
            return
        self.stop.set()
        self.thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)
