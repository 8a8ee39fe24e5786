"""Fitting a rank codec's projection (``--hidden-rank R``) on the teacher's own states, once per cache.

The basis of every cached hidden layer is the top-R principal directions of the teacher's states over the
leading sequences of the data, up to ``FIT_TOKENS`` tokens: deterministic in the data order, so every rank, every
job-array part and a resumed run would fit the same one. They need not: the first process to find the cache
without a complete ``projection/`` folder fits it and stores it before any shard (the create-once protocol of the
tokenizer and teacher-head folders, ``storage.folders``), and every process then codes with the stored bytes,
read back. Under torchrun the main rank fits while the others wait at a barrier (the runner); job-array parts
started together on an object store could still both fit, which is safe when they run on the same kind of device
(the fit is deterministic there).

The moments are accumulated on the teacher's device in float64 (sum ``[d]`` and Gram matrix ``[d, d]`` per
layer, one batch of rows at a time) and the covariance is diagonalised there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kdcache.stages.precompute.core.errors import PrecomputeError
from kdcache.stages.targets.hidden.device_codecs import Projection
from kdcache.storage import HiddenCodec, Store, has_projection, read_projection, write_projection

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FIT_TOKENS = 16384  # leading tokens the basis is fitted on: several times any d it is used at, one pass
Bases = dict[str, tuple[np.ndarray, np.ndarray]]


def check_rank(codec: HiddenCodec, config: PretrainedConfig) -> None:
    """Refuse a rank outside 1..d-1 for the teacher's hidden size d (``hidden_size``, or ``d_model``), and a
    full-rank codec's (``pca8``) rank other than d.

    Raises:
        PrecomputeError: names R and d.
    """
    rank = codec.rank
    d = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    if rank is not None and isinstance(d, int) and codec.full_rank and rank != d:
        raise PrecomputeError(f"hidden_rank: R = {rank}, but codec {codec.name!r} codes full-rank PCA "
                              f"coefficients: expected R = d = {d}, the teacher's hidden size")
    if rank is not None and isinstance(d, int) and not codec.full_rank and not 1 <= rank < d:
        raise PrecomputeError(f"hidden_rank: R = {rank} must be in 1..{d - 1}: the teacher's hidden size is d = {d} "
                              f"(a projection to R >= d directions stores no fewer values than the states)")


def fit_bounds(lengths: list[int], chunk: int, tokens: int = FIT_TOKENS) -> list[tuple[int, int]]:
    """Sequence ranges ``[start, stop)`` of ``chunk`` sequences covering the leading sequences up to ``tokens``
    tokens (the first sequence to reach it included), in data order."""
    stop = int(np.searchsorted(np.cumsum(lengths), tokens)) + 1
    stop = min(stop, len(lengths))
    return [(start, min(start + chunk, stop)) for start in range(0, stop, chunk)]


def fit_bases(batches: Iterable[list[dict[str, np.ndarray]]], names: list[str], rank: int,
              device: torch.device) -> Bases:
    """Top-``rank`` (R) principal directions of each projected array in ``names`` (``hidden/3``...) over the
    sequences of ``batches`` (lists of per-sequence dicts of float32 rows ``[L_i, d]``), summed and diagonalised on
    ``device`` (the teacher's): ``{name: (basis [R, d], mean [d])}`` float32 numpy, the basis rows orthonormal, by
    decreasing variance.

    Raises:
        PrecomputeError: fewer tokens than R + 1 to fit on.
    """
    moments: dict[str, tuple[int, Any, Any]] = {}
    for items in batches:
        for name in names:
            rows = torch.from_numpy(np.concatenate([item[name] for item in items])).to(device, torch.float64)
            count, total, gram = moments.get(name, (0, 0.0, 0.0))
            moments[name] = (count + len(rows), total + rows.sum(0), gram + rows.T @ rows)
    return {name: _principal(name, *moments[name], rank=rank) for name in names}


def _principal(name: str, count: int, total: torch.Tensor, gram: torch.Tensor, *, rank: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """(basis ``[R, d]``, mean ``[d]``) from the token count, the sum ``[d]`` and the Gram matrix ``[d, d]``."""
    if count <= rank:
        raise PrecomputeError(f"hidden_rank: {name} has only {count} tokens to fit R = {rank} directions on; "
                              f"cache more data or lower --hidden-rank")
    mean = total / count
    values, vectors = torch.linalg.eigh(gram / count - torch.outer(mean, mean))  # ascending eigenvalues
    basis = vectors[:, -rank:].flip(1).T  # [R, d], largest variance first
    # An eigenvector's sign is arbitrary; fix it (largest entry positive) so equal data gives equal bases.
    signs = torch.sign(basis.gather(1, basis.abs().argmax(1, keepdim=True)))
    return (basis * signs).float().cpu().numpy(), mean.float().cpu().numpy()


def stored_projection(store: Store, rank: int, names: list[str], fit: Callable[[], Bases]) -> Projection:
    """The cache's rank-``rank`` projection: read from the ``projection/`` folder of the run's output ``store``, or
    fitted (``fit``) and stored there first when it is absent; always the stored bytes (another process may have
    stored its own first)."""
    if not has_projection(store):
        write_projection(store, fit())
    return Projection.from_arrays(read_projection(store, names, rank))
