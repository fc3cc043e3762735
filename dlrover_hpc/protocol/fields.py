"""Message fields as JSON and back: the type checks and conversions of the wire codec."""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any

#: Row classes sent as arrays of their field values, in field order (see :func:`positional`).
_POSITIONAL: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def positional(cls: type) -> type:
    """Send rows of ``cls`` (a dataclass of plain fields, constructible by position) as
    arrays, not objects: the master reads 16,000 rank rows a second at 4,096 nodes, and an
    array of 13 values decodes and builds in a fifth of an object's time.  Objects with the
    same fields are still read."""
    names = [f.name for f in dataclasses.fields(cls)]
    if any(_converts(h) for h in hints(cls).values()):
        raise TypeError(f"{cls.__name__}: only rows of plain fields can be sent as arrays")
    _POSITIONAL[cls] = operator.attrgetter(*names)
    return cls


#: the types :func:`plain` returns as they are, at one comparison
_AS_IS = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """A field value as JSON: enums by value, nested rows as objects (or arrays, for the
    :func:`positional` row classes); others as they are."""
    if type(value) in _AS_IS:
        return value
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
        values = _POSITIONAL.get(type(value[0]))
        if values is not None and all(type(v) is type(value[0]) for v in value):
            return [list(values(v)) for v in value]
        return [fields(v) for v in value]
    return value


def fields(obj: Any) -> dict[str, Any]:
    # A shallow field copy, not dataclasses.asdict: asdict deep-copies every list.
    names = _NAMES.get(type(obj))
    if names is None:
        names = _NAMES[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: plain(getattr(obj, name)) for name in names}


#: a message or row class's field names, in order (cached: every frame written)
_NAMES: dict[type, tuple[str, ...]] = {}


def matches(value: Any, hint: Any) -> bool:
    """``value``, as JSON decoded it, fits ``hint`` (a row: an object with exactly its
    fields, each fitting)."""
    return _checker(hint)(value)


#: hint -> its compiled check: a heartbeat of 8 ranks' progress was checked field by field
#: through typing's introspection, ~220 us a message (2,048 heartbeats a second at 4,096 nodes)
_CHECKERS: dict[Any, Callable[[Any], bool]] = {}


def _checker(hint: Any) -> Callable[[Any], bool]:
    found = _CHECKERS.get(hint)
    if found is None:
        found = _CHECKERS[hint] = _compile(hint)
    return found


def _is_number(value: Any) -> bool:
    kind = type(value)
    if kind is float or kind is int:
        return True
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))


#: field types whose values JSON gives back as exactly that type (a bool is not an int here:
#: a row with a bool field never took the one-comparison path, 8 rows every heartbeat)
_EXACT = (int, float, str, bool)


def _exact_types(cls: Any) -> tuple[type | None, ...]:
    """A row class's field types in field order, None where a value's type alone does not
    tell (an array row whose values' types equal this passes without a field's check)."""
    row = hints(cls)
    return tuple(row[f.name] if row[f.name] in _EXACT else None for f in dataclasses.fields(cls))


def _row(item: type, value: Any) -> Any:
    """A checked row of plain fields as ``item``: from an array (by position) or an object."""
    if type(value) is list:
        return item(*value)
    return value if isinstance(value, item) else item(**value)


def _compile(hint: Any) -> Callable[[Any], bool]:
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value: True
    if isinstance(hint, type) and issubclass(hint, Enum):
        values = frozenset(e.value for e in hint)
        return lambda value: isinstance(value, hint) or value in values
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        row = {k: _checker(h) for k, h in hints(hint).items()}
        names = frozenset(row)
        # A field of a plain type whose value is exactly that type (or an int for a float)
        # passes without its check's call: 8 rows of 13 fields in every heartbeat.
        exact = {k: h for k, h in hints(hint).items() if h in _EXACT}
        # An array row (positional): its values in field order, each checked as above.
        by_position = [(exact.get(k), row[k]) for k in (f.name for f in dataclasses.fields(hint))]
        # The common case in one comparison: every value exactly its field's type.
        types_in_order = _exact_types(hint)

        def check_row(value: Any) -> bool:
            if isinstance(value, hint):
                return True
            if type(value) is list:
                if hint not in _POSITIONAL or len(value) != len(by_position):
                    return False
                if tuple(map(type, value)) == types_in_order:
                    return True
                for v, (kind, check) in zip(value, by_position, strict=True):
                    got = type(v)
                    if not (got is kind or (kind is float and got is int) or check(v)):
                        return False
                return True
            if not isinstance(value, dict) or value.keys() != names:
                return False
            for k, v in value.items():
                kind, got = exact.get(k), type(v)
                if got is kind or (kind is float and got is int):
                    continue
                if not row[k](v):
                    return False
            return True

        return check_row
    if origin in (typing.Union, types.UnionType):
        options = [_checker(h) for h in typing.get_args(hint)]
        return lambda value: any(check(value) for check in options)
    if hint is type(None):
        return lambda value: value is None
    if hint is float:
        return _is_number
    if hint is int:
        return _is_int
    if origin is list:
        (item,) = typing.get_args(hint)
        each = _checker(item)
        return lambda value: isinstance(value, list) and all(each(v) for v in value)
    if origin is dict:
        return lambda value: isinstance(value, dict)
    return lambda value: isinstance(value, hint)


_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The field types of a message or row class (cached)."""
    found = _HINTS.get(cls)
    if found is None:
        found = _HINTS[cls] = {k: v for k, v in typing.get_type_hints(cls).items() if k != "TYPE"}
    return found


def typed(value: Any, hint: Any) -> Any:
    """``value`` (already checked by :func:`matches`) as ``hint``'s enum or row type."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(value)
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if isinstance(item, type) and dataclasses.is_dataclass(item):
            row = hints(item)
            if _plain_row(item):  # plain fields: as they are
                return [_row(item, v) for v in value]
            return [
                v if isinstance(v, item) else item(**{k: typed(x, row[k]) for k, x in v.items()})
                for v in value
            ]
    return value


_PLAIN: dict[type, bool] = {}


def _plain_row(cls: type) -> bool:
    """No field of the row class ``cls`` is converted by :func:`typed` (cached: asked for
    every heartbeat)."""
    found = _PLAIN.get(cls)
    if found is None:
        found = _PLAIN[cls] = not any(_converts(h) for h in hints(cls).values())
    return found


def _converts(hint: Any) -> bool:
    """:func:`typed` changes values of this hint (an enum, a list of rows)."""
    if isinstance(hint, type) and issubclass(hint, Enum):
        return True
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(item, type) and dataclasses.is_dataclass(item)
    return False


class Mismatch(Exception):
    """A field's value does not fit its type (raised by a :data:`Reader`'s functions)."""


#: A field's read, by name, per message class: its value checked (:func:`matches`) and
#: converted (:func:`typed`), or :class:`Mismatch`; one lookup per field read, not a hint's
#: hash and its introspection (every heartbeat's four fields, every join's twenty).
Reader = dict[str, Callable[[Any], Any]]
_READERS: dict[type, Reader] = {}


def reader(cls: type) -> Reader:
    """How each field of ``cls`` is read (cached)."""
    found = _READERS.get(cls)
    if found is None:
        found = _READERS[cls] = {name: _read(hint) for name, hint in hints(cls).items()}
    return found


def _read(hint: Any) -> Callable[[Any], Any]:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        if item in _POSITIONAL and _plain_row(item):
            return _read_rows(item, _checker(item))
    check, convert = _checker(hint), _conversion(hint)
    if convert is None:

        def read(value: Any) -> Any:
            if check(value):
                return value
            raise Mismatch

        return read

    def read_converted(value: Any) -> Any:
        if check(value):
            return convert(value)
        raise Mismatch

    return read_converted


def _read_rows(item: type, check_row: Callable[[Any], bool]) -> Callable[[Any], Any]:
    """A list of :func:`positional` rows of plain fields, checked and built in one pass: a
    heartbeat's 8 ranks, 4,096 rows a second at 4,096 nodes."""
    in_order = _exact_types(item)

    def read_rows(value: Any) -> Any:
        if type(value) is not list:
            raise Mismatch
        out = []
        for v in value:
            if type(v) is list and tuple(map(type, v)) == in_order:
                out.append(item(*v))  # the common case: every value exactly its field's type
            elif check_row(v):
                out.append(_row(item, v))
            else:
                raise Mismatch
        return out

    return read_rows


def _conversion(hint: Any) -> Callable[[Any], Any] | None:
    """:func:`typed` for ``hint``, without its introspection at each call (None: none)."""
    if not _converts(hint):
        return None
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint
    (item,) = typing.get_args(hint)
    if not _plain_row(item):
        return functools.partial(typed, hint=hint)

    def rows(value: list[Any]) -> list[Any]:  # rows of plain fields (arrays by position)
        return [_row(item, v) for v in value]

    return rows
