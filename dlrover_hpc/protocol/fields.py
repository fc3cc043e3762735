"""Message fields as JSON and back: the type checks and conversions of the wire codec."""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any


def plain(value: Any) -> Any:
    """A field value as JSON: enums by value, nested rows as objects; others as they are."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        return [fields(v) for v in value]
    return value


def fields(obj: Any) -> dict[str, Any]:
    # A shallow field copy, not dataclasses.asdict: asdict deep-copies every list.
    return {f.name: plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if isinstance(hint, type) and issubclass(hint, Enum):
        return isinstance(value, hint) or value in {e.value for e in hint}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, hint) or (isinstance(value, dict) and _row_matches(value, hint))
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint)


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The field types of a message or row class (cached)."""
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TYPE"}
    return found


def _row_matches(value: dict[str, Any], cls: type) -> bool:
    row = hints(cls)
    return set(value) == set(row) and all(matches(v, row[k]) for k, v in value.items())


def typed(value: Any, hint: Any) -> Any:
    """``value`` (already checked by :func:`matches`) as ``hint``'s enum or row type."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            row = hints(item)
            return [
                v if isinstance(v, item) else item(**{k: typed(x, row[k]) for k, x in v.items()})
                for v in value
            ]
    return value
