"""Pure parsers of Slurm command output (tested on verbatim captured output)."""

from __future__ import annotations

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
