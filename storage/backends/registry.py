"""Backends by name. Kept apart from ``base`` so that the interface never imports its implementations."""

from __future__ import annotations

from kdcache.storage.backends.arrow_backend import ArrowBackend
from kdcache.storage.backends.base import Backend
from kdcache.storage.backends.zarr_backend import ZarrBackend
from kdcache.storage.errors import SpecError
from kdcache.storage.formats import CURRENT, CacheFormat

BACKENDS: dict[str, type[Backend]] = {"zarr": ZarrBackend, "arrow": ArrowBackend}


def get_backend(name: str, cache_format: CacheFormat = CURRENT) -> Backend:
    """The backend registered under ``name`` ("zarr" or "arrow"), reading shards of ``cache_format`` (an open
    cache's ``manifest.format``; the current format by default, the only one written)."""
    if name not in BACKENDS:
        raise SpecError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}")
    return BACKENDS[name](cache_format)
