"""The switch list of DLRover's user guide: one node per line, `ASW PSW HOST`.

ASW is the node's access (leaf) switch, PSW the pod switch above that ASW, HOST a host name or IP
address. Fields are separated by blanks; `#` starts a comment. In the model an ASW is a leaf
switch with the hosts as nodes and a PSW an upper switch with the ASWs as children.
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrover_hpc.topology.model import (
    Problem,
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    bad_name_reason,
    check,
    sort_problems,
    switch_levels,
)
from dlrover_hpc.topology.order import rank_order
from dlrover_hpc.topology.slurm_conf import split_comment

HEADER_COLUMNS = ("ASW", "PSW", "HOST")


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """One `ASW PSW HOST` line."""

    asw: str
    psw: str
    host: str
    line: int
    comment: str = ""


def scan_entries(text: str, *, source: str) -> tuple[list[Entry], list[Problem]]:
    """The well-formed entries of a switch list and the problems of every line."""
    entries: list[Entry] = []
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        content, comment = split_comment(raw)
        fields = content.split()
        if not fields:
            continue

        def problem(kind: ProblemKind, message: str, number: int = number) -> Problem:
            return Problem(kind=kind, source=source, line=number, message=message)

        if len(fields) != 3:
            hint = (
                " (this looks like topology.conf syntax: give the file a 'SwitchName=' line"
                " first, or write 'ASW PSW HOST')"
                if "=" in content
                else ""
            )
            problems.append(
                problem(
                    ProblemKind.BAD_SYNTAX,
                    f"expected 3 fields 'ASW PSW HOST' (access switch, pod switch, host), got"
                    f" {len(fields)}{hint}; write one node per line, e.g. 'asw-0 psw-0 node1'",
                )
            )
            continue
        asw, psw, host = fields
        bad = False
        for what, value in (("access switch", asw), ("pod switch", psw), ("host", host)):
            reason = bad_name_reason(value)
            if reason is None:
                continue
            bad = True
            fix = (
                "write one host per line"
                if what == "host" and ("[" in value or "," in value)
                else "use a plain name"
            )
            problems.append(
                problem(
                    ProblemKind.BAD_NAME,
                    f"{what} '{value}' is not one name ({reason}); {fix}",
                )
            )
        if not bad:
            entries.append(Entry(asw=asw, psw=psw, host=host, line=number, comment=comment))
    return entries, problems


def entries_to_topology(entries: list[Entry], *, source: str) -> tuple[Topology, list[Problem]]:
    """Build the two-level tree from entries; returns it with the problems found on the way."""
    problems: list[Problem] = []
    leaf_nodes: dict[str, list[str]] = {}
    leaf_line: dict[str, int] = {}
    pod_of: dict[str, tuple[str, int]] = {}
    pod_children: dict[str, list[str]] = {}
    pod_line: dict[str, int] = {}
    host_at: dict[str, Entry] = {}

    def problem(kind: ProblemKind, line: int, message: str) -> Problem:
        return Problem(kind=kind, source=source, line=line, message=message)

    for e in entries:
        earlier = host_at.setdefault(e.host, e)
        if earlier is not e:
            if earlier.asw == e.asw:
                problems.append(
                    problem(
                        ProblemKind.DUPLICATE_NODE,
                        e.line,
                        f"host '{e.host}' is listed again (also on line {earlier.line});"
                        " list each host once: delete one of the lines",
                    )
                )
            else:
                problems.append(
                    problem(
                        ProblemKind.NODE_UNDER_TWO_LEAVES,
                        e.line,
                        f"host '{e.host}' is under two access switches, '{earlier.asw}' (line"
                        f" {earlier.line}) and '{e.asw}'; a host hangs off one access switch:"
                        " delete one of the lines",
                    )
                )
            continue
        pod, pod_first = pod_of.setdefault(e.asw, (e.psw, e.line))
        if pod != e.psw:
            problems.append(
                problem(
                    ProblemKind.SWITCH_UNDER_TWO_PODS,
                    e.line,
                    f"access switch '{e.asw}' is under pod switch '{pod}' on line {pod_first}"
                    f" but under '{e.psw}' here; an access switch has one pod switch: make the"
                    " PSW column agree",
                )
            )
            continue
        leaf_nodes.setdefault(e.asw, []).append(e.host)
        leaf_line.setdefault(e.asw, e.line)
        pod_line.setdefault(e.psw, e.line)
        kids = pod_children.setdefault(e.psw, [])
        if e.asw not in kids:
            kids.append(e.asw)
    reported: set[str] = set()
    for e in entries:
        if e.asw in pod_line and e.asw not in reported:
            reported.add(e.asw)
            if e.asw == e.psw:
                what = f"'{e.asw}' is both the access switch and the pod switch of this line"
            else:
                what = (
                    f"'{e.asw}' is an access switch here and a pod switch on line {pod_line[e.asw]}"
                )
            problems.append(
                problem(
                    ProblemKind.SWITCH_AT_TWO_LEVELS,
                    e.line,
                    f"{what}; a switch name is either an ASW or a PSW: rename one",
                )
            )
    switches = [
        Switch(name=asw, nodes=tuple(nodes), line=leaf_line[asw])
        for asw, nodes in leaf_nodes.items()
    ]
    switches.extend(
        Switch(name=psw, switches=tuple(kids), line=pod_line[psw])
        for psw, kids in pod_children.items()
        if psw not in leaf_nodes
    )
    topology = Topology(switches=tuple(switches), source=source, format=TopologyFormat.SWITCH_LIST)
    return topology, problems


def scan_switch_list(text: str, *, source: str) -> tuple[Topology, list[Problem]]:
    """Parse a switch list; returns what could be parsed and every problem found."""
    entries, problems = scan_entries(text, source=source)
    topology, tree_problems = entries_to_topology(entries, source=source)
    problems.extend(tree_problems)
    if not problems:
        problems.extend(check(topology))
    return topology, list(sort_problems(problems))


def parse_switch_list(text: str, *, source: str) -> Topology:
    """Parse a switch list; raises TopologyProblems listing every problem."""
    topology, problems = scan_switch_list(text, source=source)
    if problems:
        raise TopologyProblems(problems)
    return topology


def switch_list_rows(topology: Topology) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(ASW, PSW, HOST) rows in rank order, and what a switch list cannot say about the tree.

    Raises TopologyError when a leaf has no parent switch: the format needs a PSW for each ASW.
    """
    levels = switch_levels(topology)
    leaf_of = topology.leaf_of()
    primary = topology.primary_parent()
    parents = topology.parents()
    by_name = topology.by_name()
    losses: list[str] = []
    orphans = [
        Problem(
            kind=ProblemKind.UNSUPPORTED,
            source=topology.source,
            line=sw.line,
            message=f"leaf switch '{sw.name}' has no parent switch, but a switch list needs a"
            f" pod switch (PSW) for every access switch: add e.g."
            f" 'SwitchName=pod0 Switches={sw.name}'",
        )
        for sw in topology.switches
        if sw.nodes and sw.name not in primary
    ]
    if orphans:
        raise TopologyProblems(orphans)
    for sw in topology.switches:
        if levels.get(sw.name, 0) > 1:
            losses.append(
                f"switch '{sw.name}' (level {levels[sw.name]}) is above the pod switches; a"
                " switch list has no column for it"
            )
        if sw.link_speed is not None:
            losses.append(f"LinkSpeed={sw.link_speed} of switch '{sw.name}' is dropped")
    for child, its_parents in parents.items():
        if len(its_parents) > 1 and child in by_name and by_name[child].nodes:
            losses.append(
                f"access switch '{child}' is kept under its first parent '{its_parents[0]}';"
                f" {', '.join(repr(p) for p in its_parents[1:])} are dropped"
            )
    rows = [(leaf_of[host], primary[leaf_of[host]], host) for host in rank_order(topology)]
    return rows, losses


def format_rows(rows: list[tuple[str, str, str]]) -> list[str]:
    """Rows as aligned `ASW PSW HOST` lines."""
    w_asw = max((len(r[0]) for r in rows), default=0)
    w_psw = max((len(r[1]) for r in rows), default=0)
    return [f"{a:<{w_asw}}  {p:<{w_psw}}  {h}" for a, p, h in rows]


def render_switch_list(topology: Topology, *, header: str = "") -> str:
    """Switch-list text for `topology`, hosts in rank order (see `switch_list_rows`)."""
    rows, _ = switch_list_rows(topology)
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    lines.append("# " + " ".join(HEADER_COLUMNS))
    lines.extend(format_rows(rows))
    return "\n".join(lines) + "\n"
