"""Pure parsers of Slurm command output (tested on verbatim captured output)."""

from __future__ import annotations

import dataclasses
import re

_KEY = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/.]*)=")


def parse_oneliner(line: str, *, free_text_last: str | None = None) -> dict[str, str]:
    """``scontrol -o show node|job X``: one line of ``Key=Value`` pairs; values may hold spaces
    (``Reason=dlrover-hpc: link down [root@2026-11-21T21:15:53]``).  ``free_text_last`` names a
    key printed last whose value is free text (a node's ``Reason``): it runs to the line's end."""
    text = line.strip()
    matches = list(_KEY.finditer(text))
    for i, m in enumerate(matches):
        if m.group(1) == free_text_last:
            matches = matches[: i + 1]
            break
    out: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out[m.group(1)] = text[m.end() : end].strip()
    return out


def node_state(fields: dict[str, str]) -> tuple[str, frozenset[str]]:
    """``State=IDLE+DRAIN`` -> ``("IDLE", {"DRAIN"})``."""
    base, *flags = fields.get("State", "UNKNOWN").split("+")
    return base, frozenset(flags)


def parse_sinfo_nodes(text: str) -> dict[str, str]:
    """``sinfo -h -N -o '%N %t'`` -> ``{node: short state}``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return out


def parse_time_left(text: str) -> float | None:
    """``squeue -o %L`` (``[days-][hours:]minutes:seconds``) in seconds; None when the job has
    no limit (``UNLIMITED``, ``NOT_SET``, ``INVALID``) or the text is not a duration."""
    value = text.strip()
    days = 0
    if "-" in value:
        head, value = value.split("-", 1)
        if not head.isdigit():
            return None
        days = int(head)
    parts = value.split(":")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(days * 86400 + seconds)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlurmNode:
    """One node of ``scontrol -o show node``: its state (``MIXED``), the state's flags
    (``DRAIN``, ``FAIL``, ``NOT_RESPONDING``, ...) and the reason an admin or Slurm gave,
    with its ``[user@time]`` stamp ("" when it has none)."""

    name: str
    state: str
    flags: frozenset[str]
    reason: str


_NAME, _STATE, _REASON = "NodeName=", " State=", " Reason="


def parse_show_nodes(text: str) -> dict[str, SlurmNode]:
    """``scontrol -o show node HOSTLIST`` (one line per node) -> ``{node: SlurmNode}``.

    Only ``NodeName``, ``State`` and the free-text ``Reason`` (printed last) are read, by
    string search: a line is about 1 kB, so a job of 4,096 nodes is 4 MB per look, and the
    other fields are not wanted.  A line that is not a node's (``Node node5 not found``) is
    skipped."""
    out: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        if not line.startswith(_NAME):
            continue
        space, at = line.find(" "), line.find(_STATE)
        name = line[len(_NAME) : space]
        if space < 0 or not name or at < 0:
            continue
        at += len(_STATE)
        end = line.find(" ", at)
        base, *flags = line[at : end if end >= 0 else len(line)].split("+")
        cut = line.find(_REASON)
        reason = line[cut + len(_REASON) :].strip() if cut >= 0 else ""
        out[name] = SlurmNode(name=name, state=base, flags=frozenset(flags), reason=reason)
    return out
