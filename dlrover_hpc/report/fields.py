"""The fields of ``events.jsonl`` that the report reads, and their types.

A line whose field has the wrong type (``"step": "thirty"``, ``"nodes": null``) would otherwise
end the report with a traceback, or, for ``"event": 5``, quietly change its figures; each is
checked as the line is read, and the first bad one is named with its file and line.
Fields the report only prints (``reason``, ``rank``) take any value.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping

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
    EventName.NETCHECK_RESULT: ({}, {"seconds": Kind.NUMBER}),
}
#: Any event may name its node; a hang names its suspect.
_ANY: Mapping[str, Kind] = {"node": Kind.NODE, "suspected_node": Kind.NODE}


def _fits(value: object, kind: Kind) -> bool:
    if isinstance(value, bool):
        return False
    match kind:
        case Kind.NUMBER:
            return isinstance(value, int | float)
        case Kind.INT:
            return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        case Kind.TEXT:
            return isinstance(value, str)
        case Kind.NAMES:
            return isinstance(value, list) and all(isinstance(n, str) for n in value)
        case Kind.NODE:
            return value is None or isinstance(value, str)
        case Kind.TIME:
            return value is None or isinstance(value, int | float)


def problem(event: Mapping[str, object]) -> str | None:
    """``field X: expected ..., got ...; fix: ...`` for the first bad field, or None."""
    for key, kind in COMMON.items():
        if key not in event:
            return f"field {key}: missing; fix: every line is a JSON object with 'time' and 'event'"
        if not _fits(event[key], kind):
            return _bad(key, kind, event[key])
    required, optional = _FIELDS.get(str(event["event"]), ({}, {}))
    for key, kind in required.items():
        if key not in event:
            return f"field {key}: missing from a {event['event']} event; fix: {_fix(key, kind)}"
        if not _fits(event[key], kind):
            return _bad(key, kind, event[key])
    for table in (optional, _ANY):
        for key, kind in table.items():
            if key in event and not _fits(event[key], kind):
                return _bad(key, kind, event[key])
    return None


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
