"""Typed configs: dataclass fields become CLI flags and YAML keys, validated before any model loads.

Each stage owns a plain dataclass of its options (``stages.precompute.options.PrecomputeOptions``,
``stages.train.options.TrainOptions``); the stages never import this module. Here we turn such a dataclass
into argparse flags and YAML keys, merge the two sources (CLI wins), and report *every* problem at once —
unknown keys, wrong types, then the dataclass's own ``validate()`` findings — as one ``ConfigError``.

Field conventions understood here:

* ``metadata={"help": "..."}`` gives the flag's help text; ``metadata={"flag": "--top-k"}`` overrides the
  flag name (default: ``--field-name``); ``metadata={"choices": [...]}`` restricts values;
  ``metadata={"const": v}`` lets the flag stand alone, meaning ``v``.
* Supported annotations: ``int``, ``float``, ``str``, ``bool``, ``tuple[int, ...]``, ``tuple[str, ...]``,
  and ``X | None`` of those. Tuples accept a YAML list or a comma-separated string ("2,4,6").
* A dataclass may define ``validate(self) -> list[str]`` for checks across fields or against the disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kdcache.storage.errors import KdcacheError

T = TypeVar("T")


class ConfigError(KdcacheError):
    """One or more configuration problems, all listed in the message."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """Return (inner type, is_optional) for ``X | None`` / ``Optional[X]``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is tuple:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    else:
        name = getattr(inner, "__name__", str(inner))
    return f"{name} or null" if optional else name


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML or CLI value to the field type ``tp``.

    Raises:
        ValueError: with a message naming ``key``, the value and the expected type.
    """
    inner, optional = _unwrap_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ValueError(f"{key}: got null, expected {_type_name(tp)}")
    try:
        return _coerce_inner(value, inner)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: got {value!r}, expected {_type_name(tp)}") from None


def _coerce_inner(value: Any, tp: Any) -> Any:
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise TypeError(value)
        return tuple(_coerce_inner(v, item) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise TypeError(value)
    if tp is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise TypeError(value)
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise TypeError(value)
        return float(value)
    if tp is str:
        if isinstance(value, (dict, list)):
            raise TypeError(value)
        return str(value)
    return value


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def add_arguments(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per field of dataclass ``cls``; unset flags stay absent from the namespace."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        tp = hints[f.name]
        inner, _ = _unwrap_optional(tp)
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, tuple):
            default = ",".join(map(str, default))
        help_text = str(f.metadata.get("help", ""))
        if "choices" in f.metadata:
            help_text += f"; one of: {', '.join(map(str, f.metadata['choices']))}"
        if "default" not in help_text and default not in (None, ""):  # a help text that explains its own default
            help_text += f" (default: {default})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if inner is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = f.metadata.get("metavar", f.name.upper())
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if "const" in f.metadata:  # the flag alone means this value
                kwargs.update(nargs="?", const=f.metadata["const"])
        parser.add_argument(_flag(f), **kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML or not a mapping.
    """
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


def build(cls: type[T], values: dict[str, Any], *, where: str = "") -> T:
    """Build dataclass ``cls`` from ``values``, collecting every problem before raising.

    Args:
        cls: the options dataclass.
        values: merged YAML + CLI values (keys are field names; dashes are accepted too).
        where: a prefix for messages, e.g. "precompute." for a YAML section.

    Raises:
        ConfigError: listing unknown keys, wrong types, missing required fields and ``validate()`` findings.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("-", "_")
        if key not in fields:
            problems.append(f"unknown key {where}{raw_key!r}; known keys: {', '.join(sorted(fields))}")
            continue
        try:
            kwargs[key] = coerce(value, hints[key], where + key)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        choices = fields[key].metadata.get("choices")
        if choices and kwargs[key] not in choices and kwargs[key] is not None:
            problems.append(f"{where}{key}: got {kwargs[key]!r}, expected one of {', '.join(map(str, choices))}")
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in kwargs and not any(p.startswith(where + name + ":") for p in problems):
            problems.append(f"{where}{name} is required (flag {_flag(f)})")
    obj = None
    if not any("is required" in p for p in problems):
        # Validate even when some keys were bad, so a user sees a missing file and a typo in one go.
        obj = cls(**kwargs)
        found = obj.validate() if hasattr(obj, "validate") else []
        problems.extend(f"{where}{p}" for p in found)
    if problems or obj is None:
        raise ConfigError(problems)
    return obj


def from_args(cls: type[T], args: argparse.Namespace, *, section: str | None = None) -> T:
    """Merge ``--config`` YAML (optionally one ``section`` of it) with the flags given, then build."""
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        data = load_yaml(config_path)
        if section is not None:
            data = data.get(section) or {}
            if not isinstance(data, dict):
                raise ConfigError([f"section {section!r} of {config_path!r} must be a mapping"])
        values.update(data)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values.update({k: v for k, v in vars(args).items() if k in names})
    return build(cls, values)
