"""Typed configs: dataclass fields become CLI flags and YAML keys, validated before any model loads.

Each stage owns a frozen dataclass of its options (``stages.precompute.core.options.PrecomputeOptions``,
``stages.train.core.options.TrainOptions``), plain or made of groups (``TrainOptions.loss``...,
``stages.common.option_groups``) whose option names stay flat in flags and YAML; the stages never import this
module. Two libraries do the mapping:

* argparse, through its public API only, takes one flag per field (``top_k`` -> ``--top-k``, booleans with
  ``--no-...`` right after them, help and choices from ``field.metadata``, extra flag names from
  ``metadata["aliases"]``), built here from the dataclass fields;
* pydantic validates the merged YAML + CLI values against the field types and reports *every* error at once.

Here we only merge the two sources (CLI wins), list unknown keys and bad choices, and add the dataclass's own
``validate()`` findings, all in one ``ConfigError``. Tuples accept a YAML list or a comma-separated string
("2,4,6"); ``none`` / ``null`` mean None where a field is optional.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from kdcache.stages.common.option_groups import flatten, groups, leaves, nest, option_loc, required
from kdcache.stages.common.stream_options import ALIASES, alias_flags, flag_name, fold_aliases
from kdcache.stages.precompute.core.options import PrecomputeOptions
from kdcache.stages.precompute.generation.options import GenerateOptions
from kdcache.stages.train.core.options import TrainOptions
from kdcache.storage import KdcacheError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

T = TypeVar("T")


class ConfigError(KdcacheError):
    """One or more configuration problems, all listed in the message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


# ---- flags -------------------------------------------------------------------------------------------------
def flags(cls: type, *, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """A parent parser (``ArgumentParser(parents=[flags(cls)])``) with one flag per field of dataclass ``cls``.

    Flags given on the command line land in the namespace as the strings typed (choices checked by argparse);
    absent ones stay absent, so ``from_args`` can tell them from YAML values and pydantic converts them all.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_flags(parser, cls, skip=skip)
    return parser


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> list[argparse.Action]:
    """Add a flag for every leaf option of ``cls`` (all but ``skip``) to ``parser``, a named group's under its own
    heading ("loss options"), in field order.

    Returns:
        the actions of the fields without a default: argparse must not demand them (``--config`` may give them
        instead), so the caller's usage line marks them itself (``pipeline.cli``).
    """
    sections: dict[str | None, Any] = {}
    needed: list[argparse.Action] = []
    for path, owner, f in leaves(cls):
        group = path[0] if path else None  # a nested group's flags stay under its outer group's heading
        if f.name in skip:
            continue
        if group not in sections:
            sections[group] = parser.add_argument_group(f"{group} options") if group else parser
        action = _add_flag(sections[group], f, typing.get_type_hints(owner)[f.name])
        needed += [action] if required(f) else []
    alias_flags(parser, [f.name for _, _, f in leaves(cls) if f.name not in skip])  # --encoder-layers...
    return needed


# What a field's metadata may hand to argparse; the rest (aliases, stage, required...) is read by kdcache itself.
_ARGPARSE_KEYS = ("help", "choices", "metavar", "nargs", "const")


class FlagSection(typing.Protocol):
    """Where flags go: a parser or one of its argument groups (argparse's public ``add_argument``)."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...


def _add_flag(section: FlagSection, f: dataclasses.Field, hint: object) -> argparse.Action:
    """One option's flag (``top_k`` -> ``--top-k`` plus ``metadata["aliases"]``), a boolean's ``--no-X`` right
    after it; returns the flag's action.

    Every value stays the raw string typed (no ``type=``) so that pydantic converts them all and reports every
    error at once; only a flag with choices converts, since argparse compares the choices to the value.
    """
    meta = {k: v for k, v in f.metadata.items() if k in _ARGPARSE_KEYS}  # other keys are the options' own
    inner, needed = _unwrap_optional(hint)[0], required(f)
    default = f.default
    if needed:
        default = None
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    meta["help"] = _help_text(meta.get("help") or "", meta.get("choices"), default, needed)
    if inner is bool:  # --X alone, or --X true|false (a YAML true is turned off by --no-X)
        meta.update(nargs="?", const=True, metavar=meta.get("metavar", "true|false"))
    if meta.get("choices") is not None and inner in (int, float, str):
        meta["type"] = inner
    flag = flag_name(f.name)
    action: argparse.Action = section.add_argument(flag, *f.metadata.get("aliases", []), dest=f.name,
                                                   default=argparse.SUPPRESS, **meta)
    if inner is bool:
        section.add_argument("--no-" + flag[2:], dest=f.name, action="store_false", default=argparse.SUPPRESS,
                             help=f"turn {flag} off")
    return action


def _help_text(text: str, choices: Iterable[object] | None, default: object, required: bool) -> str:
    """A flag's help with its choices, its default as one would type it, and whether it is required."""
    if choices is not None:
        text += ("; " if text else "") + f"one of: {', '.join(map(str, choices))}"
    if isinstance(default, tuple):
        default = ",".join(map(str, default))
    elif isinstance(default, bool):
        default = str(default).lower()  # as it is typed: --offload true|false
    elif default is not None and not isinstance(default, (int, float, str)):
        default = str(default)  # a value with its own text (a layer map)
    if "default" not in text and default not in (None, ""):
        text += f" (default: {default})"
    return text + (" (required: the flag or its --config key)" if required else "")


def given_values(cls: type, args: argparse.Namespace, section: str | None, *, skip: tuple[str, ...] = ()
                 ) -> tuple[dict[str, Any], list[str]]:
    """``--config`` YAML (``config_values``: the command's ``section``, or the whole of a flat file) with the flags
    given (all but ``skip``) over it, and the file's problems."""
    config_path = getattr(args, "config", None)
    values, problems = config_values(cls, config_path, section) if config_path else ({}, [])
    names = ({f.name for _, _, f in leaves(cls)} | set(ALIASES)) - set(skip)
    values.update({k: v for k, v in vars(args).items() if k in names})
    return values, problems


def from_args(cls: type[T], args: argparse.Namespace, *, section: str | None = None) -> T:
    """Build ``cls`` from ``given_values``; every problem of the file and of the values in one ConfigError."""
    values, problems = given_values(cls, args, section)
    try:
        built = build(cls, values)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if problems:
        raise ConfigError(problems)
    return built


# The commands a --config file may hold a section for, with their options classes (imported here: the stages
# never import this module); ``kdcache run`` reads stage one's (precompute or generate) and train's from one file.
SECTIONS: dict[str, type] = {"precompute": PrecomputeOptions, "generate": GenerateOptions, "train": TrainOptions}


def config_values(cls: type, path: str | Path, section: str | None) -> tuple[dict[str, Any], list[str]]:
    """The keys ``--config`` file ``path`` gives the command of options class ``cls``, and the problems found.

    A file with a ``precompute:`` or ``train:`` section gives its ``section`` (another command's section is
    left to that command). A file without sections is flat: its top-level keys are the command's options (or
    its groups, ``loss: {gamma: 0.5}``). Either way each key the command does not take is a problem naming the
    key, the file and the close matches, and is left out of the values.
    """
    data, sections = load_yaml(path), {*SECTIONS, *([section] if section else [])}
    if section is not None and any(key in sections for key in data):
        problems = [f"{path}: top-level key {key!r} beside the sections {', '.join(sorted(sections))}; a file "
                    f"with sections keeps each key in one" for key in data if key not in sections]
        data, where = data.get(section) or {}, f"{path} ({section}: section)"
        if not isinstance(data, dict):
            return {}, problems + [f"section {section!r} of {str(path)!r} must be a mapping"]
    else:
        problems, where = [], f"{path}"
    values, unknown = _known_keys(cls, data, where, section)
    return values, problems + unknown


def _known_keys(cls: type, data: dict[str, Any], where: str, section: str | None
                ) -> tuple[dict[str, Any], list[str]]:
    """``data`` without the keys ``cls`` does not take, and one problem for each such key."""
    known = option_names(cls)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in flat_values(cls, data).items():
        name = str(key).replace("-", "_")
        if name in known:
            values[key] = value
            continue
        other = [s for s, c in SECTIONS.items() if s != section and name in option_names(c)]
        if section is not None and other:
            problems.append(f"{where}: key {key!r} is an option of `kdcache {other[0]}`, not of `kdcache "
                            f"{section}`; a file for both keeps each command's keys under its own "
                            f"{', '.join(repr(s + ':') for s in SECTIONS)} section, as `kdcache run` reads it")
            continue
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        options = sorted(f.name for _, _, f in leaves(cls))  # the aliases are deprecated: not offered
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; known keys: {', '.join(options)}"
        problems.append(f"{where}: unknown key {key!r}{hint}")
    return values, problems


def option_names(cls: type) -> set[str]:
    """The option names ``cls`` takes, and the deprecated aliases of its options."""
    names = {f.name for _, _, f in leaves(cls)}
    return names | {alias for alias, (option, _) in ALIASES.items() if option in names}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping; a ConfigError where the file is missing, unreadable, not YAML or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"config file {str(p)!r} does not exist"])
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError([f"config file {str(p)!r} is not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config file {str(p)!r} must hold a mapping, got {type(data).__name__}"])
    return data


# ---- values ------------------------------------------------------------------------------------------------
def build(cls: type[T], values: dict[str, Any], *, where: str = "") -> T:
    """Build options class ``cls`` (flat, or made of groups) from ``values``, collecting every problem first.

    Args:
        values: merged YAML + CLI values, flat (keys are option names; dashes are accepted too); a group's name
            may also map to a mapping of its options.
        where: a prefix for messages, e.g. "precompute." for a YAML section.

    Raises:
        ConfigError: listing unknown keys, wrong types, missing required fields, bad choices and ``validate()``
            findings.
    """
    fields = {f.name: (owner, f) for _, owner, f in leaves(cls)}
    given = {str(k).replace("-", "_"): v for k, v in flat_values(cls, values).items()}
    given, problems = fold_aliases(given, {k: typing.get_type_hints(o)[k] for k, (o, _) in fields.items()},
                                   where=where)
    problems += [f"unknown key {where}{k!r}; known keys: {', '.join(sorted(fields))}" for k in given if k not in fields]
    given = {k: _prepare(fields[k][0], k, v) for k, v in given.items() if k in fields}
    # A field with a default that this class still requires (a shared group's, see option_groups.required):
    # pydantic would take the default, so it is named here as pydantic names a missing field.
    problems += [f"{where}{k} is required (flag {flag_name(k)})" for k, (_, f) in fields.items()
                 if f.metadata.get("required") and given.get(k) in (None, "")]
    obj, type_problems = _validate(cls, given, where)
    problems += type_problems
    if obj is not None:
        problems += [f"{where}{p}" for p in _choice_problems(obj)]
        # validate() runs even when some keys were bad (on the rest), so a user sees a missing file and a typo
        # in one go.
        problems += [f"{where}{p}" for p in (obj.validate() if hasattr(obj, "validate") else [])]
    if problems or obj is None:
        raise ConfigError(problems)
    return obj


def flat_values(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a YAML section) with a whole group given as a mapping (``loss: {gamma: 0.5}``) spread into
    its options."""
    names = groups(cls) or {}
    flat: dict[str, Any] = {}
    for key, value in values.items():
        flat.update(value if key in names and isinstance(value, dict) else {key: value})
    return flat


def _prepare(owner: type, key: str, value: object) -> object:
    """The spellings pydantic does not read: "2,4,6" for a tuple, none/null for an optional field, and YAML
    numbers where text is expected (``revision: 20240101``, ``layers: [1, 3]``)."""
    inner, optional = _unwrap_optional(typing.get_type_hints(owner)[key])
    if optional and isinstance(value, str) and value.lower() in ("none", "null"):
        return None
    if typing.get_origin(inner) is tuple and isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if typing.get_origin(inner) is tuple and isinstance(value, list) and typing.get_args(inner)[0] is str:
        return [_text(v) for v in value]
    return _text(value) if inner is str else value


def _text(value: object) -> object:
    """A YAML number as the text it was written as; anything else unchanged (pydantic judges it)."""
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _unwrap_optional(tp: object) -> tuple[object, bool]:
    """(inner type, is optional) of ``X | None``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return tp, False


def _validate(cls: type[T], values: dict[str, Any], where: str) -> tuple[T | None, list[str]]:
    """pydantic's validation of flat ``values``: (the object or None, one message per error).

    On errors the object is built again without the bad keys (their defaults stand in) so that ``validate()``
    can still look at the rest; it stays None when a required field is missing or bad.
    """
    import pydantic  # off the light path: `kdcache --help` builds the flags here without it

    adapter = pydantic.TypeAdapter(cls)
    try:
        return adapter.validate_python(nest(cls, values)), []
    except pydantic.ValidationError as exc:
        errors = exc.errors(include_url=False)
    locs = [option_loc(cls, e["loc"]) for e in errors]  # a grouped class's errors are at (group, option, ...)
    problems = [_message(loc, e, where) for loc, e in zip(locs, errors)]
    bad = {loc[0] for loc in locs if loc}
    try:
        return adapter.validate_python(nest(cls, {k: v for k, v in values.items() if k not in bad})), problems
    except pydantic.ValidationError:
        return None, problems


def _message(loc: tuple[Any, ...], error: ErrorDetails, where: str) -> str:
    """One pydantic error as ``key: got VALUE, MESSAGE`` (or ``key is required (flag --key)``)."""
    key = str(loc[0])
    if error["type"] == "missing":
        return f"{where}{key} is required (flag {flag_name(key)})"
    item = "".join(f"[{i}]" for i in loc[1:])
    message = str(error["msg"]).replace("Input should be", "expected").removeprefix("Value error, ")
    return f"{where}{key}{item}: got {error['input']!r}, {message[0].lower()}{message[1:]}"


def _choice_problems(obj: object) -> list[str]:
    """Values outside a field's ``metadata["choices"]`` (YAML values; argparse already checks the flags)."""
    values = flatten(obj)
    problems = []
    for _, _, f in leaves(type(obj)):
        value, choices = values[f.name], f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            problems.append(f"{f.name}: got {value!r}, expected one of {', '.join(map(str, choices))}")
    return problems
