"""The one registry every kind in kdcache uses: hidden codecs, their array operations, backends, attention layouts
and logit layouts here; attention sources, logit kinds and losses in stages.

A registry is a dict from a name to its entry, in the order entries were added (the order the flags' choices and
the errors list them); a test may add an entry of its own and delete it again. ``lookup`` is the one place an
unknown name is refused, with a message naming every registered one.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Collection, Iterable
from typing import TypeVar

T = TypeVar("T")


class Registry(dict[str, T]):
    """Entries of one kind by name.

    Args:
        what: the kind's name in messages (``"hidden codec"``, ``"backend"``).
        error: the exception an unknown name raises (a ``KdcacheError`` subclass the kind's callers catch).
    """

    def __init__(self, what: str, error: type[Exception]) -> None:
        super().__init__()
        self.what, self.error = what, error

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` (a later entry of the same name replaces it); returns the entry."""
        self[name] = entry
        return entry

    def names(self) -> list[str]:
        """The registered names, in the order they were added."""
        return list(self)

    def lookup(self, name: object) -> T:
        """The entry registered as ``name``.

        Raises:
            self.error: naming ``name`` and every registered name.
        """
        if not isinstance(name, str) or name not in self:
            raise self.error(f"unknown {self.what} {name!r}; expected one of {', '.join(self)}")
        return self[name]


def import_members(package: str, path: Iterable[str], *, but: Collection[str] = ("base",)) -> None:
    """Import every module of ``package`` (its ``__path__``) but those named in ``but`` (the interface and its
    helpers), in name order: a registry package whose modules each register one entry is complete once its
    ``__init__`` calls this."""
    for module in pkgutil.iter_modules(path):
        if module.name not in but:
            importlib.import_module(f"{package}.{module.name}")
