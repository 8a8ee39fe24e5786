"""A rank-R projection's bases in the cache: the ``projection/`` folder, plain ``.npy`` files readable by numpy.

For every projected array (``hidden/3``, ``encoder/hidden/2``) the folder holds ``{stem}.basis.npy`` ``[R, d]``
float32 (orthonormal rows: the top-R principal directions of the teacher's own states) and ``{stem}.mean.npy``
``[d]`` float32, where ``stem`` is the array name with ``/`` as ``.`` (``hidden.3``). The folder is written once,
before any shard, by whichever process finds it absent, and sealed by its file table like the tokenizer's
(``storage.folders``); every rank, job-array part and resumed run then reads the same bytes. Decoding:
``x = coef @ basis + mean`` (``storage.hidden_codecs.decode``).
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np

from kdcache.storage.core.errors import ManifestError
from kdcache.storage.core.store_base import Store
from kdcache.storage.folders import folder_is_complete, put_files

PROJECTION_DIR = "projection"
Bases = dict[str, tuple[np.ndarray, np.ndarray]]  # array name -> (basis [R, d], mean [d]) float32


def file_stem(name: str) -> str:
    """The file stem of array ``name``'s basis and mean: ``hidden/3`` -> ``hidden.3``."""
    return name.replace("/", ".")


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=np.float32), allow_pickle=False)
    return buffer.getvalue()


def write_projection(store: Store, bases: Mapping[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Write the bases (``{name: (basis [R, d], mean [d])}``) as ``projection/``; a complete folder already
    there (another rank's, an earlier run's) is kept."""
    files = {}
    for name, (basis, mean) in sorted(bases.items()):
        files[f"{file_stem(name)}.basis.npy"], files[f"{file_stem(name)}.mean.npy"] = _npy(basis), _npy(mean)
    put_files(store, PROJECTION_DIR, files)


def has_projection(store: Store) -> bool:
    """Whether the cache holds a complete ``projection/`` folder."""
    return folder_is_complete(store, PROJECTION_DIR)


def read_projection(store: Store, names: list[str], rank: int) -> Bases:
    """The bases of ``names`` from ``projection/``, each checked to be ``[rank, d]`` and ``[d]`` float32.

    Raises:
        ManifestError: the folder or a file is missing, unreadable, or of another shape.
    """
    if not has_projection(store):
        raise ManifestError(f"the cache at {store.url} stores rank-{rank} projection coefficients but has no "
                            f"complete {PROJECTION_DIR}/ folder of bases; rerun stage one")
    return {name: _read_pair(store, name, rank) for name in names}


def _read_pair(store: Store, name: str, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """``(basis [R, d], mean [d])`` of ``name``, shapes and dtypes checked."""
    pair = []
    for part in ("basis", "mean"):
        key = f"{PROJECTION_DIR}/{file_stem(name)}.{part}.npy"
        try:
            pair.append(np.load(io.BytesIO(store.read(key)), allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise ManifestError(f"{store.url}/{key}: cannot read the projection {part} of {name} ({exc})") from None
    basis, mean = pair
    if basis.dtype != np.float32 or basis.ndim != 2 or basis.shape[0] != rank or mean.shape != basis.shape[1:]:
        raise ManifestError(f"{store.url}/{PROJECTION_DIR}: the basis of {name} is {basis.dtype} {basis.shape} "
                            f"with mean {mean.shape}; expected float32 [{rank}, d] and [d] (rank {rank})")
    return basis, mean
