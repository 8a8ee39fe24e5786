"""Options made of groups: a frozen dataclass whose fields are frozen dataclasses (``TrainOptions.loss``...).

Flags, YAML keys, sweep grids and ``RUN/options.json`` stay flat (``--gamma``, ``gamma: 0.5``): every leaf name
is unique across the groups, so a flat mapping routes to its group without ambiguity. A class whose fields are
plain values is its own single group, so the same helpers serve flat option classes too.

A group class shared by both stages (``stages.common.engine_options.EngineOptions``) marks each field with the
stage using it (``metadata["stage"]``), and each stage's options mark the group field the same way: a stage's
leaves are the group's fields of its stage (and any unmarked ones), so the other stage's never become its flags
or keys.

A group may hold a group (``option_group``: ``TargetOptions.logit``, the logit family's flags): its fields are
leaves of the outer class like the rest, at a longer path, so a family declares its flags once, in its folder.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

from kdcache.stages.common.stream_options import StreamValueError, fold_aliases

T = TypeVar("T")


def groups(cls: type) -> dict[str, type] | None:
    """Group name -> group class, or None when ``cls`` has plain fields (a flat option class)."""
    hints = typing.get_type_hints(cls)
    found = {f.name: hints[f.name] for f in dataclasses.fields(cls)}
    return found if all(dataclasses.is_dataclass(tp) for tp in found.values()) else None


def option(default: T, help_text: str, **meta: object) -> T:
    """A leaf option: its default, its flag's help and any other ``metadata`` (choices, aliases, metavar...)."""
    return dataclasses.field(default=default, metadata={"help": help_text, **meta})


def option_group(cls: type[T]) -> T:
    """A field holding group ``cls`` inside a group: its fields become leaves of the outer options (defaults:
    ``cls()``)."""
    return dataclasses.field(default_factory=cls, metadata={"group": True})


def leaves(cls: type) -> Iterator[tuple[tuple[str, ...], type, dataclasses.Field]]:
    """(path of group names, () for a flat class; the class holding the field; the field) for every leaf option
    of ``cls``: of a group marked with a stage, only the fields of that stage."""
    named = groups(cls)
    stage_of = {f.name: f.metadata.get("stage") for f in dataclasses.fields(cls)} if named else {}
    for group, group_cls in (named or {None: cls}).items():  # type: ignore[dict-item]
        for path, owner, f in _members(group_cls, (group,) if group else ()):
            if f.metadata.get("stage") in (None, stage_of.get(group)):
                yield path, owner, f


def _members(cls: type, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], type, dataclasses.Field]]:
    """The leaves of group ``cls`` at ``path``, a nested group's (``option_group``) in its place."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
            yield from _members(typing.get_type_hints(cls)[f.name], (*path, f.name))
        else:
            yield path, cls, f


def option_loc(cls: type, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """A validation error's location ``(group, ..., option, index...)`` from its option on."""
    for path, _, f in leaves(cls):
        if loc[:len(path)] == path and loc[len(path):len(path) + 1] == (f.name,):
            return loc[len(path):]
    return loc


def required(f: dataclasses.Field) -> bool:
    """Whether leaf ``f`` must be given: it has no default, or a shared group's default stands in only for the
    stage that does not use it (``metadata["required"]``)."""
    no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    return no_default or bool(f.metadata.get("required"))


def nest(cls: type, flat: dict[str, Any]) -> dict[str, Any]:
    """Route flat ``{leaf: value}`` to ``{group: {leaf: value}}``, a nested group's leaves one level further
    (unchanged for a flat class).

    Raises:
        KeyError: a key that is no option of ``cls`` (``pipeline.config`` reports those first).
    """
    path_of = {f.name: path for path, _, f in leaves(cls)}
    nested: dict[str, Any] = {name: {} for name in groups(cls) or {}}
    for key, value in flat.items():
        functools.reduce(lambda node, name: node.setdefault(name, {}), path_of[key], nested)[key] = value
    return nested


def assemble(cls: type[T], flat: dict[str, Any]) -> T:
    """``cls`` built from flat ``{option: value}`` as the flags name them (tests, benchmarks), values read by
    pydantic as the config would read them (a layer map may be text); no ``validate()``: ``pipeline.config.build``
    is the checked way in."""
    import pydantic  # off the light path: option classes and their flags (`--help`) stay without it

    types = {f.name: typing.get_type_hints(owner)[f.name] for _, owner, f in leaves(cls)}
    flat, problems = fold_aliases(flat, types)  # decoder_layer_map=... as the config reads it
    if problems:
        raise StreamValueError("; ".join(problems))
    return pydantic.TypeAdapter(cls).validate_python(nest(cls, flat))


def flatten(options: object) -> dict[str, Any]:
    """``{leaf: value}`` of an options object, grouped or flat (values as they are)."""
    return {f.name: getattr(functools.reduce(getattr, path, options), f.name) for path, _, f in leaves(type(options))}
