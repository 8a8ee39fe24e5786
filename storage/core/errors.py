"""Typed errors for kdcache.

Every error kdcache raises on purpose derives from :class:`KdcacheError`, so the CLI can turn any of them into
one clean ``error: ...`` line (exit status 2) instead of a traceback. Other packages subclass it too.
Messages always name the offending value and say what was expected.
"""

from __future__ import annotations


class KdcacheError(Exception):
    """Base class of every deliberate kdcache error. Keyword facts given with the message (``shard=3``) become
    attributes, for a caller that acts on them; a subclass declares the ones it carries."""

    def __init__(self, *args: object, **facts: object) -> None:
        super().__init__(*args)
        declared = {name for cls in type(self).__mro__ for name in vars(cls).get("__annotations__", {})}
        if unknown := sorted(set(facts) - declared):  # a misspelt fact would otherwise be kept silently
            raise TypeError(f"{type(self).__name__} carries the facts {sorted(declared)}, not {unknown}")
        self.__dict__.update(facts)


class SpecError(KdcacheError, ValueError):
    """A CacheSpec field has an invalid value (bad backend, dtype, layer list, top-k...)."""


class UnknownCodecError(KdcacheError, ValueError):
    """A codec name or configuration is not known, or cannot be used where it was asked for."""


class UnknownFeatureError(KdcacheError, KeyError):
    """An array or feature name that this cache (or this format) does not hold."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class LayerNotInCacheError(UnknownFeatureError):
    """A hidden or attention layer that was not selected when the cache was written."""


class FormatVersionError(KdcacheError):
    """The cache was written by a newer (or unknown) format version than this code reads."""


class ManifestError(KdcacheError):
    """manifest.json (or a shard sidecar) is missing, unreadable or inconsistent."""


class PartialCacheError(KdcacheError):
    """The cache is not complete: its writer is still running, or died before finalizing."""


class ChecksumError(KdcacheError):
    """Stored bytes of one array of one shard do not match the checksum recorded at commit time."""

    shard: int
    array: str


class Fp16OverflowError(KdcacheError, OverflowError):
    """A float target holds a value that float16 cannot represent (it would become inf)."""

    name: str
    max_abs: float


class NonFiniteValueError(KdcacheError, ValueError):
    """A float target holds NaN or inf before any conversion (a teacher bug, not a range problem)."""


class InvalidSequenceError(KdcacheError, ValueError):
    """A sequence handed to the writer has a missing array, a wrong shape or a wrong dtype."""


class ShardError(KdcacheError):
    """A shard index is out of range, belongs to another part, is already committed, or is not committed."""


class CacheMismatchError(KdcacheError):
    """An existing cache was created with a different spec or different fingerprints."""

    differences: list[str]


class CacheLockedError(KdcacheError):
    """Another live process holds the lock of the same writer part."""


class DiskFullError(KdcacheError, OSError):
    """The file system holding the cache is full (ENOSPC) or the user's quota is spent (EDQUOT)."""

    needed: int
    free: int

    def __str__(self) -> str:  # OSError would otherwise print its args tuple
        return str(self.args[0]) if self.args else ""


class StorageError(KdcacheError):
    """The cache's location cannot be used: unknown URL scheme, missing fsspec backend, no such bucket,
    wrong credentials, unreachable endpoint."""
