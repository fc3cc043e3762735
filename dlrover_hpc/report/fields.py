"""The fields of ``events.jsonl`` that the report reads, and their types.

A line whose field has the wrong type (``"step": "thirty"``, ``"nodes": null``) would otherwise
end the report with a traceback, or, for ``"event": 5``, quietly change its figures; each is
checked as the line is read, and the first bad one is named with its file and line.
Fields the report only prints (``reason``, ``rank``) take any value.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping

from dlrover_hpc.events import EventName


class Kind(enum.Enum):
    NUMBER = "a number"
    INT = "a whole number"
    TEXT = "a string"
    NAMES = "a list of node names (strings)"
    NODE = "a node name (a string) or null"
    TIME = "a number or null"


#: Every event: its fields that must be there, and their kinds.
COMMON: Mapping[str, Kind] = {"time": Kind.NUMBER, "event": Kind.TEXT}
#: (required, optional) fields of an event, by its name; an optional field may be absent.
_FIELDS: Mapping[str, tuple[Mapping[str, Kind], Mapping[str, Kind]]] = {
    EventName.JOB_STARTED: ({}, {}),
    EventName.JOB_FINISHED: ({}, {"exit_code": Kind.INT, "restart_count": Kind.INT}),
    EventName.RENDEZVOUS_COMPLETE: (
        {"round": Kind.INT, "nodes": Kind.NAMES},
        {"restart_count": Kind.INT},
    ),
    EventName.TRAINING_PROGRESS: ({"round": Kind.INT, "step": Kind.INT}, {"at": Kind.TIME}),
    EventName.CHECKPOINT_SAVED: ({"step": Kind.INT}, {"blocking_s": Kind.NUMBER}),
    EventName.CHECKPOINT_PERSISTED: ({"step": Kind.INT}, {"persist_s": Kind.NUMBER}),
    EventName.CHECKPOINT_RESTORED: ({"step": Kind.INT}, {"restore_s": Kind.NUMBER}),
    EventName.RESTORE_REJECTED: (
        {"step": Kind.INT, "source": Kind.TEXT, "why": Kind.TEXT},
        {"next_step": Kind.INT},
    ),
    EventName.NETCHECK_RESULT: ({}, {"seconds": Kind.NUMBER}),
    EventName.NODE_UNHEALTHY: ({"check": Kind.TEXT}, {}),
    EventName.CRASH_LOOP: ({"rounds": Kind.INT}, {"rank": Kind.INT}),
    EventName.PERSIST_STALLED: ({"seconds": Kind.NUMBER}, {"since": Kind.TIME}),
}
#: Any event may name its node; a hang names its suspect.
_ANY: Mapping[str, Kind] = {"node": Kind.NODE, "suspected_node": Kind.NODE}


_NUMBERS = (int, float)  # by type(): a bool is neither


def _is_names(value: object) -> bool:
    return type(value) is list and all(type(n) is str for n in value)


_FITS: Mapping[Kind, Callable[[object], bool]] = {
    Kind.NUMBER: lambda v: type(v) in _NUMBERS,
    Kind.INT: lambda v: type(v) is int or (type(v) is float and v.is_integer()),
    Kind.TEXT: lambda v: type(v) is str,
    Kind.NAMES: _is_names,
    Kind.NODE: lambda v: v is None or type(v) is str,
    Kind.TIME: lambda v: v is None or type(v) in _NUMBERS,
}
_MISSING = object()
Check = tuple[str, bool, Kind, Callable[[object], bool]]  # key, required, kind, fits
_ANY_CHECKS: tuple[Check, ...] = tuple((k, False, kind, _FITS[kind]) for k, kind in _ANY.items())
#: An event's checks, by its name, in the order they run (an event not named: _ANY_CHECKS).
_CHECKS: Mapping[str, tuple[Check, ...]] = {
    str(name): (
        *((k, True, kind, _FITS[kind]) for k, kind in required.items()),
        *((k, False, kind, _FITS[kind]) for k, kind in optional.items()),
        *_ANY_CHECKS,
    )
    for name, (required, optional) in _FIELDS.items()
}


def problem(event: Mapping[str, object]) -> str | None:
    """``field X: expected ..., got ...; fix: ...`` for the first bad field, or None.  About
    a microsecond an event: a log of millions is read in seconds."""
    time, name = event.get("time", _MISSING), event.get("event", _MISSING)
    if type(time) not in _NUMBERS or type(name) is not str:
        return _common(event)
    for key, required, kind, fits in _CHECKS.get(name, _ANY_CHECKS):
        value = event.get(key, _MISSING)
        if value is _MISSING:
            if required:
                return f"field {key}: missing from a {event['event']} event; fix: {_fix(key, kind)}"
        elif not fits(value):
            return _bad(key, kind, value)
    return None


def _common(event: Mapping[str, object]) -> str:
    for key, kind in COMMON.items():
        if key not in event:
            return f"field {key}: missing; fix: every line is a JSON object with 'time' and 'event'"
        if not _FITS[kind](event[key]):
            return _bad(key, kind, event[key])
    raise AssertionError("the common fields are fine")  # pragma: no cover


def _bad(key: str, kind: Kind, value: object) -> str:
    shown = json.dumps(value, default=str)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return f"field {key}: expected {kind.value}, got {shown}; fix: {_fix(key, kind)}"


def _fix(key: str, kind: Kind) -> str:
    example = {
        Kind.NUMBER: "1718000000.5" if key == "time" else "2.5",
        Kind.INT: "3",
        Kind.TEXT: '"job_started"',
        Kind.NAMES: '["node1", "node2"]',
        Kind.NODE: '"node1"',
        Kind.TIME: "1718000000.5",
    }[kind]
    return f'write "{key}": {example} on this line, or remove the line'
