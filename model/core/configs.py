"""Frozen-dataclass configs: build from dicts, apply typed `key=value` overrides.

Every config in echoic is a frozen dataclass living beside the code that uses it.
This module is the one place that turns TOML tables and command-line overrides
into those dataclasses, so an unknown key or a badly typed value is always an
error that names the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config key is unknown or its value has the wrong type."""


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, kind: Any, key: str) -> Any:
    origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        if isinstance(value, kind):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return from_dict(kind, value, prefix=key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is typing.Literal:
        allowed = typing.get_args(kind)
        if value not in allowed:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(kind)
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if kind is Any:
        return value
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported config type {kind!r}")


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build `cls` from a (nested) dict; unknown keys are an error naming the key."""
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        known = ", ".join(sorted(types_))
        raise ConfigError(f"unknown config key {prefix}{unknown[0]!s} (known here: {known})")
    kwargs = {k: _coerce(v, types_[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def to_dict(cfg: Any, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON-safe nested dict (tuples become lists), without the dotted keys in `exclude`."""
    data = json.loads(json.dumps(dataclasses.asdict(cfg)))
    for key in exclude:
        *parents, last = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        del node[last]
    return data


def _parse_literal(text: str) -> Any:
    """Parse an override value the way TOML would: numbers, booleans, lists, strings."""
    low = text.strip()
    if low in ("true", "false"):
        return low == "true"
    try:
        return json.loads(low)
    except json.JSONDecodeError:
        return text


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """Apply `a.b.c=value` overrides to a frozen config, with the field's type checked."""
    data = dataclasses.asdict(cfg)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node: Any = data
        node_cls: Any = type(cfg)
        for depth, part in enumerate(parts):
            types_ = _field_types(node_cls)
            if part not in types_:
                where = ".".join(parts[:depth]) or "the top level"
                raise ConfigError(
                    f"unknown config key {key.strip()} ({part!r} is not a key of {where};"
                    f" known: {', '.join(sorted(types_))})"
                )
            if depth == len(parts) - 1:
                node[part] = _parse_literal(raw)
            else:
                node_cls = types_[part]
                if not dataclasses.is_dataclass(node_cls):
                    raise ConfigError(f"config key {'.'.join(parts[: depth + 1])} is not a table")
                node = node[part]
    return from_dict(type(cfg), data)


def config_hash(cfg: Any, exclude: tuple[str, ...] = ()) -> str:
    """A short stable hash of a config without the dotted keys in `exclude`, recorded in
    checkpoints and model cards."""
    blob = json.dumps(to_dict(cfg, exclude), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
