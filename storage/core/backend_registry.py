"""Backends by name: the one list of them, which the spec, the readers, the writer and the ``--format`` flag ask.

Kept apart from ``base`` so that the interface never imports its implementations, and each implementation loads
on first use (``backend_class``): the option classes list the names without importing zarr or pyarrow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.registry import Registry


class BackendClass(Protocol):
    """What the spec asks of a backend's class before any shard exists (``base.Backend``'s static members); typed
    here so that the registry never imports ``base``, which imports the spec."""

    codec_per_array: bool
    default_codecs: tuple[dict[str, Any], dict[str, Any]]
    check_codec: Callable[[dict[str, Any]], object]


# name -> (module, class) of its implementation; the first is the default of CacheSpec.backend and --format
_IMPLEMENTATIONS: Registry[tuple[str, str]] = Registry("backend", SpecError)
_IMPLEMENTATIONS.add("zarr", ("kdcache.storage.backends.zarr_backend", "ZarrBackend"))
_IMPLEMENTATIONS.add("arrow", ("kdcache.storage.backends.arrow_backend", "ArrowBackend"))
DEFAULT_BACKEND = next(iter(_IMPLEMENTATIONS))
backend_names = _IMPLEMENTATIONS.names  # every registered backend, the default first


def register_backend(name: str, module: str, cls: str) -> None:
    """Add backend ``name``, implemented by class ``cls`` of ``module`` (imported on first use)."""
    _IMPLEMENTATIONS.add(name, (module, cls))


def backend_class(name: str) -> BackendClass:
    """The class registered under ``name`` (its module imported now).

    Raises:
        SpecError: naming ``name`` and the registered backends.
    """
    module, cls = _IMPLEMENTATIONS.lookup(name)
    found: BackendClass = getattr(importlib.import_module(module), cls)
    return found
