"""Options whose value may differ per token stream, in one syntax, and the flags they replace.

A value is one or more items, each ``VALUE`` (every stream: a one-stream teacher's only stream, or the default of
both stacks of an encoder-decoder) or ``STREAM:VALUE`` for ``encoder``, ``decoder`` or ``cross`` (the
cross-attention blocks, for attention options)::

    --layers 2,4                          one stream, as always
    --layers all decoder:2,4 encoder:1,3  per stack
    --attention-layers cross:1,2          cross-attention blocks
    --layer-map last decoder:explicit:1-2 (stage two; any map text after the stream)

YAML takes the same text, a list of items, or a mapping ``{encoder: [1, 3], decoder: "2,4"}`` (key ``""``: every
stream). ``StreamValues`` holds one such value, parsed once by pydantic where the config is read.

The per-stack flags and YAML keys that came before (``--encoder-layers``, ``--cross-attention-map``...) are
aliases of one stream of these options: ``ALIASES`` is their one table; ``alias_flags`` adds them to a parser and
``fold_aliases`` (both called by ``pipeline.config``) moves their values into the option, printing one
deprecation note each.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kdcache.storage import KdcacheError

if typing.TYPE_CHECKING:
    from pydantic import GetCoreSchemaHandler
    from pydantic_core import CoreSchema

STREAM_PREFIXES = ("encoder", "decoder", "cross")
_ORDER = ("", *STREAM_PREFIXES)
# An item starts where whitespace is followed by a stream prefix, so "explicit:1-2, 2-4" stays one item.
_ITEM_START = re.compile(r"\s+(?=(?:" + "|".join(STREAM_PREFIXES) + r"):)")

# old option name -> (option, stream): the flags and YAML keys before per-stream values (issue 21).
ALIASES = {
    "encoder_layers": ("layers", "encoder"), "decoder_layers": ("layers", "decoder"),
    "encoder_attention_layers": ("attention_layers", "encoder"),
    "decoder_attention_layers": ("attention_layers", "decoder"),
    "cross_attention_layers": ("attention_layers", "cross"),
    "encoder_layer_map": ("layer_map", "encoder"), "decoder_layer_map": ("layer_map", "decoder"),
    "cross_attention_map": ("attention_layers", "cross"),
}

S = TypeVar("S", bound="StreamValues")


class StreamValueError(KdcacheError, ValueError):
    """A per-stream value that cannot be read (a stream given twice, an unknown mapping key)."""


@dataclass(frozen=True)
class StreamValues:
    """One option's value per stream: ``entries`` is ``((stream, value), ...)`` in the order "", encoder,
    decoder, cross; stream ``""`` is the item without a prefix. Subclasses say how one stream's text reads
    (``read``); the value itself is a tuple of strings here (layer lists).

    ``str(v)`` is the canonical text, which parses back to ``v``.
    """

    entries: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def read(text: str) -> Any:
        """One stream's value from its text: here a layer list, ``"2,4"`` -> ``("2", "4")``."""
        return tuple(t for t in re.split(r"[,\s]+", text) if t)

    @classmethod
    def parse(cls: type[S], value: object) -> S:
        """Read text, a list of items, a mapping ``{stream: value}`` or an instance (returned as is).

        Raises:
            StreamValueError: a stream given twice, or a mapping key that is no stream.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            items = [(str(k), _text(v)) for k, v in value.items()]
        elif not _text(value).strip():
            items = [("", "")]  # the empty value, for the options to judge
        else:
            items = [_split_item(item) for item in _ITEM_START.split(_text(value).strip()) if item.strip()]
        return cls.of(items)

    @classmethod
    def of(cls: type[S], items: Iterable[tuple[str, Any]]) -> S:
        """An instance from ``(stream, text or value)`` pairs; text is read by ``read``."""
        entries: dict[str, Any] = {}
        for stream, value in items:
            if stream not in _ORDER:
                raise StreamValueError(f"unknown stream {stream!r}; expected one of {list(STREAM_PREFIXES)} (or no "
                                       f"prefix for every stream)")
            if stream in entries:
                raise StreamValueError(f"stream {stream or 'without prefix'!r} is given twice")
            entries[stream] = cls.read(value) if isinstance(value, str) else value
        return cls(tuple((s, entries[s]) for s in _ORDER if s in entries))

    def get(self, stream: str, default: object = None) -> Any:
        """The value of ``stream`` (``""``: the unprefixed item), or ``default``."""
        return dict(self.entries).get(stream, default)

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams given, ``""`` included."""
        return tuple(s for s, _ in self.entries)

    def with_stream(self: S, stream: str, value: object) -> S:
        """A copy with ``stream`` set to ``value`` (text is read), replacing what it held."""
        kept = [(s, v) for s, v in self.entries if s != stream]
        return type(self).of([*kept, (stream, self.read(value) if isinstance(value, str) else value)])

    def text_of(self, stream: str) -> str:
        """The text of one stream's value (``"2,4"``)."""
        value = self.get(stream)
        return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

    def __str__(self) -> str:
        return " ".join(f"{s}:{self.text_of(s)}" if s else self.text_of(s) for s in self.streams)

    @classmethod
    def __get_pydantic_core_schema__(cls, source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
        """Let pydantic read the value from text, a list or a mapping; a bad one becomes a config problem."""
        return read_before(cls, cls.parse)


def read_before(cls: type, read: Callable[[object], object]) -> CoreSchema:
    """pydantic's schema for an option value of class ``cls`` that the config may give as text: ``read`` turns it
    into one (its errors become config problems), then it must be a ``cls``. For the classes' own
    ``__get_pydantic_core_schema__`` (this one's, ``LayerMap``'s), which only pydantic calls, as it validates."""
    from pydantic_core import core_schema  # pydantic's own: loaded by then, and never at `kdcache --help`

    return core_schema.no_info_before_validator_function(read, core_schema.is_instance_schema(cls))


class StreamLayers(StreamValues):
    """Layer lists per stream (``("all",)``, ``("2", "4")``, ``("none",)``), as stage one's options take them."""


def _text(value: object) -> str:
    """YAML numbers and lists as the text they stand for: ``[1, 3]`` -> ``"1 3"``."""
    if isinstance(value, (list, tuple)):
        return " ".join(_text(v) for v in value)
    return str(value)


def _split_item(item: str) -> tuple[str, str]:
    head, sep, rest = item.strip().partition(":")
    return (head.lower(), rest) if sep and head.lower() in STREAM_PREFIXES else ("", item.strip())


def value_class(tp: object) -> type[StreamValues] | None:
    """The ``StreamValues`` class of a field type (``X`` or ``X | None``), or None for other fields."""
    for candidate in (tp, *typing.get_args(tp)):
        if isinstance(candidate, type) and issubclass(candidate, StreamValues):
            return candidate
    return None


def fold_aliases(values: dict[str, Any], options: Mapping[str, Any], *,
                 where: str = "") -> tuple[dict[str, Any], list[str]]:
    """Move each alias of ``ALIASES`` in ``values`` into its option's stream, with one deprecation note each on
    stderr (a ``kdcache`` line, which ``--quiet`` lets through).

    Args:
        values: flat option values (YAML and flags merged), keys with underscores.
        options: option name -> field type of the class being built; aliases of options it lacks stay in
            ``values`` (reported as unknown keys).
        where: a prefix for messages, e.g. "precompute." for a YAML section.

    Returns:
        (the values, one problem per alias whose value does not read, named by the alias as the user wrote it).
    """
    out, problems = dict(values), []
    for option, tp in options.items():  # the flag's items as one text, so "none" still reads as None where optional
        if value_class(tp) is not None and isinstance(out.get(option), list):
            out[option] = _text(out[option])
    for alias, (option, stream) in ALIASES.items():
        cls = value_class(options.get(option))
        if alias not in out or cls is None:
            continue
        value = out.pop(alias)
        text, shown = _text(value), ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        print(f"kdcache config: note: {flag_name(alias)} (YAML {where}{alias}) is deprecated; write "
              f"{flag_name(option)} {stream}:{shown} (YAML {option}: {{{stream}: ...}})", file=sys.stderr)
        try:
            cls.read(text)
        except ValueError as exc:
            problems.append(f"{where}{alias}: got {text!r}, {exc}")
            continue
        try:
            out[option] = _merged(out.get(option), stream, text)
        except StreamValueError as exc:
            problems.append(f"{where}{option}: got {_text(out.pop(option))!r}, {exc}")
    return out, problems


def _merged(current: object, stream: str, text: str) -> dict[str, str]:
    """``current`` (any spelling the option takes, or None) with ``stream`` set to ``text``, as a mapping."""
    if current is None or str(current).strip().lower() in ("none", "null"):  # the option's own default
        items: list[tuple[str, str]] = []
    elif isinstance(current, StreamValues):
        items = [(s, current.text_of(s)) for s in current.streams]
    elif isinstance(current, Mapping):
        items = [(str(s), _text(v)) for s, v in current.items()]
    else:
        items = [_split_item(i) for i in _ITEM_START.split(_text(current).strip()) if i.strip()]
    StreamValues.of((s, "") for s, _ in items)  # a stream given twice is refused here as where it is read
    return {**dict(items), stream: text}


def alias_flags(parser: argparse.ArgumentParser, options: Iterable[str]) -> None:
    """Accept the alias of each of ``options`` (the parser's option names) as a flag of its own, hidden from the
    help, so that ``fold_aliases`` finds it among the values."""
    names = set(options)
    for alias, (option, _) in ALIASES.items():
        if option in names:
            parser.add_argument(flag_name(alias), dest=alias, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def flag_name(option: str) -> str:
    """The flag of an option as help and error messages print it: ``top_k`` -> ``--top-k``."""
    return "--" + option.replace("_", "-")
