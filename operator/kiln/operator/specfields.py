"""The field readers of ``spec.parse_spec``: each reads one key of a raw section with its type
checked, ``path`` naming the field in the ``EngineSpecError`` it raises."""

from __future__ import annotations

from typing import Any, Mapping

from kiln.common.enginespec import EngineSpecError


def _section(raw: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    v = raw.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise EngineSpecError(f"{path}: expected an object, got {type(v).__name__}")
    return v


def _int(raw: Mapping[str, Any], key: str, path: str, default: int | None) -> int | None:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise EngineSpecError(f"{path}: expected an integer, got {v!r}")
    return v


def _number(raw: Mapping[str, Any], key: str, path: str, default: float) -> float:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise EngineSpecError(f"{path}: expected a number, got {v!r}")
    return v


def _bool(raw: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise EngineSpecError(f"{path}: expected true or false, got {v!r}")
    return v


def _str(raw: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str | None:
    v = raw.get(key)
    if v is None or v == "":
        return default
    if not isinstance(v, str):
        raise EngineSpecError(f"{path}: expected a string, got {v!r}")
    return v


def _list(raw: Mapping[str, Any], key: str, path: str) -> list[Any]:
    v = raw.get(key)
    if v is None:
        return []
    if not isinstance(v, (list, tuple)):
        raise EngineSpecError(f"{path}: expected a list, got {type(v).__name__}")
    return list(v)


def _strings(raw: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    """An object of string values (labels, annotations); {} when absent."""
    out = {}
    for k, x in _section(raw, key, path).items():
        if not isinstance(x, str):
            raise EngineSpecError(f"{path}.{k}: expected a string, got {x!r}")
        out[str(k)] = x
    return out


def _quantities(raw: Mapping[str, Any], key: str, path: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in _section(raw, key, path).items()}
