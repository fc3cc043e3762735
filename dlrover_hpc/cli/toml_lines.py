"""Where a section or key is in a TOML file: tomllib gives values, not their lines, and an
error about a value should name its FILE:LINE."""

from __future__ import annotations

import json
import re

_BARE = r"[A-Za-z0-9_-]+"
_PART = rf"(?:{_BARE}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_KEYPATH = rf"{_PART}(?:\s*\.\s*{_PART})*"
_HEADER = re.compile(rf"\s*\[\[?\s*({_KEYPATH})\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(rf"\s*({_KEYPATH})\s*=(.*)$")
_PARTS = re.compile(_PART)


def locate(text: str) -> dict[tuple[str, ...], int]:
    """The first line of each section (``("run",)``) and key (``("run", "max_restarts")``; a
    top-level key: ``("max_restarts",)``), 1-based.  Enough TOML for our files: headers, dotted
    and quoted keys, comments, multi-line strings skipped."""
    lines: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    closing = ""  # inside a multi-line string: its delimiter
    for number, line in enumerate(text.splitlines(), start=1):
        if closing:
            if line.count(closing) % 2:
                closing = ""
            continue
        header = _HEADER.match(line)
        if header:
            table = _key_path(header.group(1))
            _record(lines, table, number)
            continue
        key = _KEY.match(line)
        if key:
            _record(lines, table + _key_path(key.group(1)), number)
            rest = key.group(2)
            closing = next((d for d in ('"""', "'''") if rest.count(d) % 2), "")
    return lines


def _record(lines: dict[tuple[str, ...], int], path: tuple[str, ...], number: int) -> None:
    for end in range(1, len(path) + 1):
        lines.setdefault(path[:end], number)


def _key_path(text: str) -> tuple[str, ...]:
    return tuple(_unquote(part) for part in _PARTS.findall(text))


def _unquote(part: str) -> str:
    if part.startswith("'"):
        return part[1:-1]
    if part.startswith('"'):
        try:
            return str(json.loads(part))
        except ValueError:
            return part[1:-1]
    return part
