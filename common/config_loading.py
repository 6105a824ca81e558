"""Loads Baton's configuration: one YAML file, overridable by ``BATON_*`` env vars, into ``common.config``.

Env overrides name a key by its path with double underscores, e.g.
``BATON_SCHEDULER__BATCH_LEVEL__MAX_BATCH_SIZE=32`` or ``BATON_EXECUTOR__DTYPE=bfloat16``.
Values are parsed as YAML scalars. An unknown key, in the file or the environment, is an error.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from common.config import BatonConfig


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"config section {path or '<root>'} must be a mapping")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown config key {path}{key!s}; known: {', '.join(sorted(known))}")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _build(typing.cast(type, hint), value or {}, f"{path}{key}.")
        else:
            kwargs[key] = _coerce(hint, value, f"{path}{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    base = hint
    if isinstance(hint, types.UnionType):
        base = next(a for a in typing.get_args(hint) if a is not type(None))
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if typing.get_origin(base) is dict:
        return _coerce_mapping(base, value, path)
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise ValueError(f"config key {path} must be {base.__name__}, got {value!r}")
    return value


def _coerce_mapping(hint: Any, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"config key {path} must be a mapping, got {value!r}")
    key_type, value_type = typing.get_args(hint)
    return {_coerce(key_type, k, f"{path}.{k}"): _coerce(value_type, v, f"{path}.{k}") for k, v in value.items()}


def _set_path(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ValueError(f"env override names a value, not a section: {'.'.join(parts)}")
        node = child
    node[parts[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Turn ``BATON_A__B=value`` variables into a nested mapping."""
    tree: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith("BATON_") or "__" not in name:
            continue
        parts = [p.lower() for p in name[len("BATON_") :].split("__")]
        _set_path(tree, parts, yaml.safe_load(raw) if raw != "" else "")
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> BatonConfig:
    """Load the YAML file (if any), apply env overrides, and validate."""
    data: dict[str, Any] = {}
    if path:
        loaded = yaml.safe_load(Path(path).read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: the top level must be a mapping")
        data = loaded or {}
    data = _merge(data, env_overrides(os.environ if environ is None else environ))
    return typing.cast(BatonConfig, _build(BatonConfig, data, ""))


def with_overrides(config: BatonConfig, **sections: Mapping[str, Any]) -> BatonConfig:
    """Return a copy with some keys replaced, e.g. from CLI flags: ``with_overrides(c, executor={"model": d})``."""
    data = dataclasses.asdict(config)
    cleaned = {k: {kk: vv for kk, vv in v.items() if vv is not None} for k, v in sections.items()}
    return typing.cast(BatonConfig, _build(BatonConfig, _merge(data, cleaned), ""))
