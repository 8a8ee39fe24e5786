"""CacheReader: random access and ordered iteration over a committed cache.

It costs what it reads: only the arrays asked for are opened and decoded, several at once in a thread pool
(codecs release the GIL), and each check covers the bytes being read (format 3: zarr's per-chunk crc32c, the
Arrow column checksums). Arrays stay in their storage dtype (fp16, or bf16 bits); widening to fp32 is the
consumer's job, on its device.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from kdcache.storage.backends.base import ShardHandle, get_backend
from kdcache.storage.core.errors import PartialCacheError, ShardError
from kdcache.storage.core.store_base import Store
from kdcache.storage.core.stores import open_store
from kdcache.storage.core.streams import prefixed, token_offsets_name
from kdcache.storage.layout import decode_rows, document_lengths, unpack_attention
from kdcache.storage.schema.manifest import Manifest, ShardRecord, read_manifest, read_sidecars
from kdcache.storage.schema.spec import CacheSpec


def default_decode_threads() -> int:
    """Decode threads when none are asked for: the cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


Fetch = Callable[[str, int, int], np.ndarray]  # (array name, start row, stop row) -> decoded rows


def _decoded(spec: CacheSpec, name: str, rows: np.ndarray) -> np.ndarray:
    """Stored rows as readers return them (gaps summed, quantised log-probs as float32)."""
    array = spec.array(name)
    step = spec.logprob_step if array.logit is not None and array.logit.logprob else 0.0
    return decode_rows(rows, gaps=array.gap_coded, logprob_step=step)


def _sequence(spec: CacheSpec, names: list[str], fetch: Fetch, offsets: dict[str, np.ndarray],
              local: int) -> dict[str, np.ndarray]:
    """Cut one sequence out of a shard's flat arrays.

    ``offsets`` maps offsets-array names (``offsets``, ``encoder/offsets``, ``attention_offsets``...) to their
    values. Attention comes back as ``[H', L, L]``; cross-attention as ``[H', L_dec, L_enc]``.
    """
    def rows(offsets_name: str) -> tuple[int, int]:
        edges = offsets[offsets_name]
        return int(edges[local]), int(edges[local + 1])

    def length(stream: str) -> int:
        start, stop = rows(spec.offsets_name(spec.ids_name(stream)))
        return stop - start

    out: dict[str, np.ndarray] = {}
    lengths_of: dict[str, list[int]] = {}

    def documents(stream: str) -> list[int]:
        """The row's document lengths, from its positions (read and split once per stream, returned with the rest)."""
        positions = prefixed(stream, "position_ids")
        if positions not in out:
            out[positions] = fetch(positions, *rows(spec.offsets_name(positions)))
        if stream not in lengths_of:
            lengths_of[stream] = document_lengths(out[positions])
        return lengths_of[stream]

    for array in map(spec.array, names):
        if array.name in out:  # position_ids already read for an attention map stored per document
            continue
        rows_ = fetch(array.name, *rows(array.offsets))
        if (geometry := array.geometry) is not None:
            docs = documents(geometry.queries) if geometry.by_documents else None
            rows_ = unpack_attention(rows_, length(geometry.queries), geometry.triangle, length(geometry.keys), docs)
        out[array.name] = rows_
    return out


@dataclass
class ShardData:
    """One decoded shard.

    Attributes:
        index: shard number; ``seq_start``/``seq_stop``: its global sequence range.
        arrays: the decoded flat arrays asked for (e.g. ``hidden/3 [T, d]``), in the storage dtype.
        all_offsets: every offsets array of the shard by name (``offsets``, ``encoder/offsets``,
            ``attention_offsets``, ``cross_attention_offsets``...), each ``[S+1]`` int64.
    """

    index: int
    seq_start: int
    seq_stop: int
    arrays: dict[str, np.ndarray]
    spec: CacheSpec
    all_offsets: dict[str, np.ndarray]

    @property
    def offsets(self) -> np.ndarray:
        """``[S+1]`` int64 token offsets of the stream logits live on (a seq2seq shard's decoder)."""
        return self.all_offsets[token_offsets_name(self.spec.streams[-1])]

    @property
    def attention_offsets(self) -> np.ndarray | None:
        """``[S+1]`` int64 offsets of the attention rows of that stream (None: no attention stored)."""
        return self.all_offsets.get(prefixed(self.spec.streams[-1], "attention_offsets"))

    def __len__(self) -> int:
        return self.seq_stop - self.seq_start

    def sequence(self, local: int) -> dict[str, np.ndarray]:
        """Shard-local sequence ``local`` as the same dict ``CacheReader.get`` returns."""
        if not 0 <= local < len(self):
            raise IndexError(f"shard {self.index} has sequences 0..{len(self) - 1} (local), got {local}")
        fetch = lambda name, a, b: self.arrays[name][a:b]  # noqa: E731
        return _sequence(self.spec, list(self.arrays), fetch, self.all_offsets, local)


class CacheReader:
    """Reads a cache written by CacheWriter (see docs/architecture.md). Thread-safe.

    Sequence indices are always global (``reader[i]`` is sequence i of the dataset). A partial cache
    (``allow_partial=True``) exposes only its committed shards; asking for a sequence elsewhere raises
    PartialCacheError.

    Args:
        path: cache folder or fsspec URL (``s3://bucket/cache``), or an open ``Store``.
        allow_partial: accept a cache whose status is not "complete".
        max_open_shards: decoded Arrow columns are cached per open shard; this bounds how many stay open.
        decode_threads: arrays decoded at once by ``read_shard``; None = the host's cores. On an object store
            each is also a request in flight.
        storage_options: fsspec options for a URL (endpoint, credentials...).

    Raises:
        ManifestError, FormatVersionError, PartialCacheError.
    """

    def __init__(self, path: str | os.PathLike[str] | Store, *, allow_partial: bool = False, max_open_shards: int = 4,
                 decode_threads: int | None = None, storage_options: Mapping[str, Any] | None = None) -> None:
        self.store = open_store(path, storage_options)
        self.root = self.store.url  # for messages: the folder or URL
        self.manifest: Manifest = read_manifest(self.store)
        self.spec: CacheSpec = self.manifest.spec
        self.fingerprints: dict[str, Any] = self.manifest.fingerprints
        self._backend = get_backend(self.spec, self.manifest.format)  # how its shards are checked
        self._records = self._visible_records(allow_partial)
        self._handles: OrderedDict[int, ShardHandle] = OrderedDict()
        self._checked: set[int] = set()
        self._max_open = max(1, max_open_shards)
        self._lock = threading.Lock()
        # Reads from an object store mostly wait on the network, so they get more threads than cores.
        self.decode_threads = decode_threads or default_decode_threads() * (1 if self.store.is_local else 4)
        self._pool: ThreadPoolExecutor | None = None

    def _visible_records(self, allow_partial: bool) -> dict[int, ShardRecord]:
        records = {r.index: r for r in self.manifest.shards}
        if self.manifest.status == "complete":
            return records
        sidecars = read_sidecars(self.store)
        committed = len(records) if self.manifest.status == "partial" else len(sidecars)
        if not allow_partial:
            raise PartialCacheError(
                f"{self.root} is not complete (status {self.manifest.status!r}, {committed} of "
                f"{self.spec.num_shards} shards committed): its writer is still running or died. Rerun the same "
                f"`kdcache precompute` command to finish it (`kdcache merge` for a job array's parts), or read "
                f"its committed shards only with `kdcache train --allow-partial`, or from Python with "
                f"`kdcache.open_cache(path, allow_partial=True)` (or `DistillationLoss(path, student, "
                f"allow_partial=True)`).")
        # While writing, the manifest lags behind: committed shards are the sidecars whose data is in place.
        for index, record in sidecars.items():
            if self.store.exists(self._backend.shard_key(index)):
                records[index] = record
        return dict(sorted(records.items()))

    # ---- what the cache holds ------------------------------------------------------------------------
    num_sequences = property(lambda self: self.spec.num_sequences, doc="Sequences in the whole cache (global).")
    num_shards = property(lambda self: self.spec.num_shards, doc="Shards in the whole cache.")
    features = property(lambda self: self.spec.features, doc='Target kinds, e.g. ("hidden", "logits/topk").')
    hidden_layers = property(lambda self: self.spec.hidden_layers)
    attention_layers = property(lambda self: self.spec.attention_layers)

    @property
    def reads_row_ranges(self) -> bool:
        """Whether a sequence's rows are read without decoding their whole array in the shard (``Backend``)."""
        return self._backend.reads_row_ranges

    @property
    def num_tokens(self) -> int:
        """Valid tokens in the visible (committed) shards."""
        return sum(r.num_tokens for r in self._records.values())

    @property
    def committed_shards(self) -> list[int]:
        """Shards this reader can read: all of them for a complete cache."""
        return list(self._records)

    @property
    def records(self) -> list[ShardRecord]:
        """Manifest records (range, tokens, bytes, checksums) of the readable shards, in shard order."""
        return list(self._records.values())

    @property
    def shard_ranges(self) -> list[tuple[int, int]]:
        """Global ``[start, stop)`` sequence range of every shard, by shard index."""
        return [self.spec.shard_range(k) for k in range(self.spec.num_shards)]

    def __len__(self) -> int:
        return self.spec.num_sequences

    # ---- opening shards ------------------------------------------------------------------------------
    def _shard(self, index: int) -> ShardHandle:
        """Open shard ``index`` (checking its checksums the first time), with a small LRU of open shards."""
        if index not in self._records:
            raise (ShardError if not 0 <= index < self.spec.num_shards else PartialCacheError)(
                f"shard {index} is not readable: committed shards are {self.committed_shards}")
        with self._lock:
            if index in self._handles:
                self._handles.move_to_end(index)
                return self._handles[index]
            handle = self._backend.open(self.store, self._records[index], self.spec)
            if index not in self._checked:
                problems = handle.check()
                if problems:
                    raise handle.fail(*problems[0])
                self._checked.add(index)
            self._handles[index] = handle
            while len(self._handles) > self._max_open:
                self._handles.popitem(last=False)
            return handle

    # ---- reading -------------------------------------------------------------------------------------
    def get(self, index: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """One sequence: ``input_ids [L]``, ``hidden/{j} [L, d]``, ``attention/{j} [H', L, L]``, logits arrays.

        Args:
            index: global sequence index.
            names: array names or groups ("hidden", "attention", "logits"); None = all.

        Raises:
            IndexError, UnknownFeatureError, LayerNotInCacheError, PartialCacheError, ChecksumError.
        """
        wanted = self.spec.expand_names(None if names is None else list(names))
        if not 0 <= index < self.num_sequences:
            raise IndexError(f"sequence {index} out of range; this cache has sequences 0..{self.num_sequences - 1}")
        shard = index // self.spec.sequences_per_shard
        local = index - shard * self.spec.sequences_per_shard
        return self._slice(self._shard(shard), wanted, local)

    def _slice(self, handle: ShardHandle, wanted: list[str], local: int) -> dict[str, np.ndarray]:
        """Read only sequence ``local``'s rows: two offsets, then a row slice of each array (partial decode)."""
        needed = {self.spec.offsets_name(n) for n in wanted}
        needed |= {self.spec.offsets_name(self.spec.ids_name(s)) for s in self.spec.streams}  # attention lengths
        offsets = {name: handle.read(name, local, local + 2) for name in needed}
        return _sequence(self.spec, wanted, lambda name, a, b: _decoded(self.spec, name, handle.read(name, a, b)),
                         offsets, 0)

    __getitem__ = get

    def read_shard(self, index: int, names: Iterable[str] | None = None) -> ShardData:
        """Decode a whole shard; only the named arrays (plus offsets) are decoded."""
        wanted = self.spec.expand_names(None if names is None else list(names))
        handle = self._shard(index)
        start, stop = self.spec.shard_range(index)
        names = [*self.spec.offset_arrays(), *wanted]
        handle.prefetch(names)  # an object store: every file of the read in one round of requests
        decoded = dict(zip(names, self._map(lambda name: _decoded(self.spec, name, handle.read(name)), names)))
        offsets = {name: decoded[name] for name in self.spec.offset_arrays()}
        return ShardData(index, start, stop, {name: decoded[name] for name in wanted}, self.spec, offsets)

    def _map(self, fn: Callable[[str], np.ndarray], names: list[str]) -> list[np.ndarray]:
        """``fn`` over ``names`` in the decode pool (created on first use), in order."""
        if self.decode_threads == 1 or len(names) == 1:
            return [fn(name) for name in names]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.decode_threads, thread_name_prefix="kdcache-read")
        return list(self._pool.map(fn, names))

    def iter_sequences(self, shards: Iterable[int] | None = None,
                       names: Iterable[str] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """Yield sequences in order, shard by shard (default: every committed shard)."""
        for index in (self.committed_shards if shards is None else shards):
            data = self.read_shard(index, names)
            for local in range(len(data)):
                yield data.sequence(local)
