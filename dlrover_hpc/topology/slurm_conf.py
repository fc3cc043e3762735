"""Slurm's topology.conf for the tree plugin: parse (with every problem's line) and write.

Syntax followed (Slurm's own config parser): one switch per line, `KEY=VALUE` pairs separated
by blanks, keys case-insensitive (`SwitchName`, `Nodes`, `Switches`, `LinkSpeed`), values may be
double-quoted, `#` starts a comment (`\\#` is a literal `#`), a trailing `\\` continues a line.
`Nodes=` and `Switches=` are Slurm hostlists, expanded by python-hostlist.
"""

from __future__ import annotations

import difflib
import shlex
from collections.abc import Callable
from dataclasses import dataclass

import hostlist

from dlrover_hpc.topology.model import (
    Problem,
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    bad_name_reason,
    check,
    natural_key,
    sort_problems,
    switch_levels,
)

KEYS = {
    "switchname": "SwitchName",
    "nodes": "Nodes",
    "switches": "Switches",
    "linkspeed": "LinkSpeed",
}
_BLOCK_KEYS = {"blockname", "blocksizes"}
_MAX_LINK_SPEED = 2**32 - 1
HOSTLIST_EXAMPLE = "node[01-04,07],gpu-a[1-2]"

ProblemMaker = Callable[[ProblemKind, str], Problem]


@dataclass(frozen=True, slots=True, kw_only=True)
class LogicalLine:
    """One logical line: physical lines `first`..`last` joined, comments removed."""

    first: int
    last: int
    text: str
    comment: str  # the comments of its physical lines, each starting with '#', joined by ' '


def split_comment(line: str) -> tuple[str, str]:
    """(content, comment) of one physical line; an unescaped '#' starts the comment."""
    i = 0
    while True:
        i = line.find("#", i)
        if i < 0:
            return line, ""
        if i > 0 and line[i - 1] == "\\":
            i += 1
            continue
        return line[:i], line[i:].rstrip("\r\n")


def logical_lines(text: str) -> list[LogicalLine]:
    """The logical lines of `text`, blank and comment-only ones included (with empty text)."""
    out: list[LogicalLine] = []
    physical = text.splitlines()
    n = 0
    while n < len(physical):
        first = n + 1
        parts: list[str] = []
        comments: list[str] = []
        while True:
            content, comment = split_comment(physical[n])
            n += 1
            if comment:
                comments.append(comment)
            content = content.rstrip()
            if content.endswith("\\") and n < len(physical):
                parts.append(content[:-1])
                continue
            parts.append(content.removesuffix("\\"))
            break
        joined = " ".join(parts).replace("\\#", "#").strip()
        out.append(LogicalLine(first=first, last=n, text=joined, comment=" ".join(comments)))
    return out


def expand(value: str) -> list[str]:
    """Expand a Slurm hostlist; raises hostlist.BadHostlist."""
    return list(hostlist.expand_hostlist(value))


def compress(names: list[str] | tuple[str, ...]) -> str:
    """The shortest Slurm hostlist python-hostlist writes for `names`."""
    return str(hostlist.collect_hostlist(list(names)))


def scan_slurm_conf(text: str, *, source: str) -> tuple[Topology, list[Problem]]:
    """Parse topology.conf text; returns what could be parsed and every problem found."""
    problems: list[Problem] = []
    switches: list[Switch] = []
    bad_lines: set[int] = set()
    for ll in logical_lines(text):
        if not ll.text:
            continue
        sw, line_problems = _parse_line(ll, source)
        if line_problems:
            bad_lines.add(ll.first)
            problems.extend(line_problems)
        if sw is not None:
            switches.append(sw)
    topology = Topology(switches=tuple(switches), source=source, format=TopologyFormat.SLURM)
    for problem in check(topology):
        # A line whose Nodes=/Switches= could not be read says so already.
        if problem.line in bad_lines and problem.kind is ProblemKind.NO_CHILDREN:
            continue
        if problem.kind is ProblemKind.EMPTY and problems:
            continue
        problems.append(problem)
    return topology, list(sort_problems(problems))


def parse_slurm_conf(text: str, *, source: str) -> Topology:
    """Parse topology.conf text; raises TopologyProblems listing every problem."""
    topology, problems = scan_slurm_conf(text, source=source)
    if problems:
        raise TopologyProblems(problems)
    return topology


def _parse_line(ll: LogicalLine, source: str) -> tuple[Switch | None, list[Problem]]:
    def problem(kind: ProblemKind, message: str) -> Problem:
        return Problem(kind=kind, source=source, line=ll.first, message=message)

    try:
        tokens = shlex.split(ll.text, comments=False, posix=True)
    except ValueError as exc:
        return None, [
            problem(ProblemKind.BAD_SYNTAX, f"cannot split the line ({exc}); close the quote")
        ]
    if tokens and tokens[0].lower() == "include":
        return None, [
            problem(
                ProblemKind.UNSUPPORTED,
                "'Include' is not supported here; paste the included file's lines instead",
            )
        ]
    values: dict[str, str] = {}
    problems: list[Problem] = []
    for token in tokens:
        key, eq, value = token.partition("=")
        if not eq or not key:
            problems.append(
                problem(
                    ProblemKind.BAD_SYNTAX,
                    f"'{token}' is not KEY=VALUE; separate pairs with blanks and keep hostlists"
                    " free of blanks (Nodes=node1,node2)",
                )
            )
            continue
        lower = key.lower()
        if lower in _BLOCK_KEYS:
            problems.append(
                problem(
                    ProblemKind.MIXED_PLUGINS,
                    f"'{key}=' is a block-plugin key in a tree topology.conf (its first line is"
                    " SwitchName=); Slurm reads one plugin's lines: keep the BlockName= lines for"
                    " TopologyPlugin=topology/block or the SwitchName= lines for topology/tree,"
                    " one file each",
                )
            )
            continue
        if lower not in KEYS:
            close = difflib.get_close_matches(lower, list(KEYS), n=1)
            hint = f"did you mean '{KEYS[close[0]]}='? " if close else ""
            problems.append(
                problem(
                    ProblemKind.UNKNOWN_KEY,
                    f"unknown key '{key}'; {hint}a topology.conf line takes SwitchName=,"
                    " Nodes=, Switches= and LinkSpeed=",
                )
            )
            continue
        canonical = KEYS[lower]
        if canonical in values:
            problems.append(
                problem(
                    ProblemKind.DUPLICATE_KEY,
                    f"'{canonical}=' is given twice on this line; give it once"
                    + (" (merge the hostlists with a comma)" if canonical != "SwitchName" else ""),
                )
            )
            continue
        if not value:
            problems.append(
                problem(
                    ProblemKind.BAD_SYNTAX,
                    f"'{key}=' has no value; give one or drop the key",
                )
            )
            continue
        values[canonical] = value
    return _build_switch(values, problem, problems, line=ll.first)


def _build_switch(
    values: dict[str, str],
    problem: ProblemMaker,
    problems: list[Problem],
    *,
    line: int,
) -> tuple[Switch | None, list[Problem]]:
    name = values.get("SwitchName")
    if name is None:
        if not problems:
            problems.append(
                problem(
                    ProblemKind.MISSING_SWITCH_NAME,
                    "no SwitchName= on this line; each line defines one switch: start it with"
                    " SwitchName=NAME",
                )
            )
        return None, problems
    reason = bad_name_reason(name)
    if reason:
        problems.append(
            problem(
                ProblemKind.BAD_NAME,
                f"switch name '{name}' is not one name ({reason}); SwitchName= takes one name:"
                " write one line per switch",
            )
        )
        return None, problems
    link_speed = None
    if "LinkSpeed" in values:
        raw = values["LinkSpeed"]
        if raw.isdigit() and int(raw) <= _MAX_LINK_SPEED:
            link_speed = int(raw)
        else:
            problems.append(
                problem(
                    ProblemKind.BAD_LINK_SPEED,
                    f"LinkSpeed={raw} is not a whole number from 0 to {_MAX_LINK_SPEED};"
                    " write e.g. LinkSpeed=100 or drop it",
                )
            )
    nodes = expand_names(values.get("Nodes"), "Nodes", problem, problems)
    switches = expand_names(values.get("Switches"), "Switches", problem, problems)
    switch = Switch(name=name, nodes=nodes, switches=switches, link_speed=link_speed, line=line)
    return switch, problems


def expand_names(
    value: str | None,
    key: str,
    problem: ProblemMaker,
    problems: list[Problem],
) -> tuple[str, ...]:
    if value is None:
        return ()
    try:
        names = expand(value)
    except hostlist.BadHostlist as exc:
        problems.append(
            problem(
                ProblemKind.BAD_HOSTLIST,
                f"malformed hostlist '{value}' in {key}= ({exc}); write a Slurm hostlist like"
                f" {HOSTLIST_EXAMPLE}",
            )
        )
        return ()
    for name in names:
        reason = bad_name_reason(name)
        if reason:
            problems.append(
                problem(
                    ProblemKind.BAD_HOSTLIST,
                    f"'{name}' in {key}= is not a valid name ({reason}); write a Slurm hostlist"
                    f" like {HOSTLIST_EXAMPLE}",
                )
            )
            return ()
    return tuple(names)


def format_switch_line(sw: Switch) -> str:
    """One topology.conf line for `sw` (no newline)."""
    parts = [f"SwitchName={sw.name}"]
    if sw.switches:
        parts.append(f"Switches={compress(sw.switches)}")
    if sw.nodes:
        parts.append(f"Nodes={compress(sw.nodes)}")
    if sw.link_speed is not None:
        parts.append(f"LinkSpeed={sw.link_speed}")
    return " ".join(parts)


def render_slurm_conf(topology: Topology, *, header: str = "") -> str:
    """topology.conf text: leaves first, then each level up, natural order within a level."""
    levels = switch_levels(topology)
    ordered = sorted(topology.switches, key=lambda s: (levels.get(s.name, 0), natural_key(s.name)))
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    lines.extend(format_switch_line(sw) for sw in ordered)
    return "\n".join(lines) + "\n"
