"""The hidden codec interface and its registry.

A codec is a class registered under its name (``@register``); a cache records it as zarr v3 names a codec,
``{"name": ..., "configuration": {...}}``, and ``resolve`` turns such a record into the codec configured by a
typed dataclass (its ``Config``). The error texts and the ``--hidden-codec`` choices come from the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from kdcache.storage.core.errors import SpecError
from kdcache.storage.core.registry import Registry
from kdcache.storage.hidden_codecs.arrays import Array

CodecRecord = dict[str, Any]  # the JSON form of a codec in a spec: {"name": str, "configuration": {key: value}}


@dataclasses.dataclass(frozen=True)
class NoConfig:
    """The configuration of a codec that takes none (the float codecs), and the base of every codec's: a dataclass
    that refuses its own bad values (``check``)."""

    def check(self, name: str) -> None:
        """Nothing to refuse."""


# Equal (and hashed) by class and configuration: a spec read back equals the spec written.
@dataclasses.dataclass(init=False, repr=False, unsafe_hash=True)
class HiddenCodec:
    """One registered codec, configured.

    Class attributes (what storage asks of a codec; none of them is a switch inside a codec):
        name: as recorded. help: one line for ``--hidden-codec``'s help.
        float_dtype: "fp16" / "bf16" for a codec that stores floats, None for one that stores codes.
        code_dtype: numpy dtype name of the stored codes (quantised codecs).
        qmax: the largest code magnitude (the fp16 scale bounds |value| <= 65504 * qmax without outliers).
        per_code: values per stored code element (2 for int4's packed nibbles).
        full_rank: coded only as full-rank projection coefficients (``rank`` = d).
        column_major: zarr stores its codes direction by direction (a byte shuffle of each row before zstd).
        Config: its configuration dataclass; ``config`` is this instance's.
    """

    name: ClassVar[str]
    help: ClassVar[str] = ""
    order: ClassVar[int] = 0  # place among the choices shown
    float_dtype: ClassVar[str | None] = None
    code_dtype: ClassVar[str | None] = None
    qmax: ClassVar[float] = 0.0
    per_code: ClassVar[int] = 1
    full_rank: ClassVar[bool] = False
    column_major: ClassVar[bool] = False
    Config: ClassVar[type] = NoConfig
    config: NoConfig

    def __init__(self, config: NoConfig | None = None) -> None:
        self.config = self.Config() if config is None else config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.record()})"

    @property
    def rank(self) -> int | None:
        """The projection's rank R (``configuration.rank``), None without a projection."""
        rank: int | None = getattr(self.config, "rank", None)
        return rank

    def record(self) -> CodecRecord:
        """The JSON record ``{"name", "configuration"}`` (keys in field order, ``rank`` last and only when set)."""
        fields = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config) if f.name != "rank"}
        rank = {"rank": self.rank} if self.rank is not None else {}
        return {"name": self.name, "configuration": {**fields, **rank}}

    def is_plain(self, dtype: str) -> bool:
        """Whether this is float ``dtype`` itself without configuration: what a cache written before hidden codecs
        holds, and records nowhere (its manifest and fingerprints leave ``hidden_codec`` out)."""
        return self.name == dtype and not self.record()["configuration"]

    def describe(self) -> str:
        """Its configuration as ``inspect`` shows it (empty for a codec that takes none)."""
        return ""

    def parts(self) -> tuple[str, ...]:
        """The companion parts stored beside the codes (``names.PARTS``; none for a float codec)."""
        return ()

    def group_count(self, d: int) -> int:
        """Scales per row of width d."""
        return 1

    def width_expectation(self, d: int) -> str | None:
        """What a row width must be, when ``d`` is not that (None when it suits)."""
        return None

    @classmethod
    def configure(cls, raw: dict[str, Any]) -> HiddenCodec:
        """The codec configured by a record's ``configuration`` (SpecError naming a bad key or value)."""
        if raw:
            raise SpecError(f"hidden codec {cls.name!r} takes no configuration, got {raw}")
        return cls()

    def encode_rows(self, x: Array) -> dict[str, Array]:
        """Rows ``x [N, d]`` float32 of any array library -> the stored parts, keyed "codes", "scale", ...
        (in ``x``'s library and on its device)."""
        raise NotImplementedError(f"hidden codec {self.name!r} stores floats: it has no codes to encode")

    def decode_rows(self, parts: dict[str, Array]) -> Array:
        """The stored parts of ``encode_rows`` (any array library) -> the rows ``[N, d]`` float32."""
        raise NotImplementedError(f"hidden codec {self.name!r} stores floats: it has no codes to decode")


C = TypeVar("C", bound=type[HiddenCodec])
HIDDEN_CODECS: Registry[type[HiddenCodec]] = Registry("hidden codec", SpecError)
get = HIDDEN_CODECS.lookup  # the codec class named ``name``, or a SpecError listing the registered ones


def register(cls: C) -> C:
    """Class decorator: make ``cls`` the codec named ``cls.name``."""
    HIDDEN_CODECS.add(cls.name, cls)
    return cls


def names() -> list[str]:
    """The registered codec names, in the order the choices show them."""
    return sorted(HIDDEN_CODECS, key=lambda name: (HIDDEN_CODECS[name].order, name))


def listing(quantised: bool = False) -> str:
    """The registered names as prose, ``"fp16, bf16, fp8, ... or pca8"`` (only those that store codes when
    ``quantised``), for help and error texts."""
    shown = [name for name in names() if not (quantised and HIDDEN_CODECS[name].float_dtype)]
    return " or ".join([", ".join(shown[:-1]), shown[-1]] if len(shown) > 1 else shown)


def usage() -> str:
    """``--hidden-codec``'s help: each codec's line, from the registry."""
    return "; ".join(f"{name}: {HIDDEN_CODECS[name].help}" for name in names())


def is_int(value: object) -> bool:
    """Whether ``value`` is an integer, and not a bool (JSON's true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)
