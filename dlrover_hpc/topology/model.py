"""The switch tree every topology format parses into, and its structural checks.

A `Topology` is a tuple of `Switch` records in the order the source defined them. A leaf switch
lists nodes, an upper switch lists child switches (Slurm's tree plugin rejects a switch with
both or neither; so do we). A switch may be listed under more than one parent (Slurm allows it,
e.g. a leaf wired to two spines); its first parent in file order is its *primary* parent, which
is the one rank ordering and the tree view follow.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dlrover_hpc.errors import TopologyError

_DIGITS = re.compile(r"(\d+)")
# Characters that can never be part of one node or switch name (they belong to hostlist syntax,
# KEY=VALUE syntax, comments or quoting).
_NOT_IN_NAME = frozenset(" \t\r\n[],=#\"'\\")

NaturalKey = tuple[tuple[str | int, ...], str]


def natural_key(name: str) -> NaturalKey:
    """Sort key that orders digit runs by value: node2 < node10, 10.0.0.9 < 10.0.0.10.

    The name itself breaks ties (node01 vs node1), so the order is total and deterministic.
    """
    parts = _DIGITS.split(name)
    key = tuple(int(p) if i % 2 else p for i, p in enumerate(parts))
    return key, name


def natural_sorted(names: Iterable[str]) -> list[str]:
    """The names in natural order (see `natural_key`)."""
    return sorted(names, key=natural_key)


def bad_name_reason(name: str) -> str | None:
    """Why `name` cannot be one node or switch name, or None when it can."""
    if not name:
        return "it is empty"
    bad = sorted({c for c in name if c in _NOT_IN_NAME})
    if bad:
        shown = ", ".join(repr(c) for c in bad)
        return f"it contains {shown}"
    return None


class TopologyFormat(enum.Enum):
    """Where a `Topology` came from; also the names `convert --to` accepts."""

    SLURM = "slurm"  # topology.conf of Slurm's tree plugin
    SWITCH_LIST = "switch-list"  # "ASW PSW HOST" lines (DLRover user guide)
    SCONTROL = "scontrol"  # output of `scontrol show topology`
    TOPOLOGY_ADDR = "slurm-topology-addr"  # SLURM_TOPOLOGY_ADDR of each node
    MEMORY = "memory"  # built in code
    BLOCK = "block"  # BlockName=/BlockSizes= lines of Slurm's block plugin (block.conf)
    SCONTROL_BLOCK = "scontrol-block"  # `scontrol show topology` under the block plugin

    @property
    def is_block(self) -> bool:
        """A block topology: each leaf "switch" is a block (an NVLink domain), none above."""
        return self in (TopologyFormat.BLOCK, TopologyFormat.SCONTROL_BLOCK)


class ProblemKind(enum.Enum):
    """What is wrong with a topology source; each `Problem` has one."""

    BAD_SYNTAX = "bad-syntax"
    UNKNOWN_KEY = "unknown-key"
    DUPLICATE_KEY = "duplicate-key"
    UNSUPPORTED = "unsupported"
    MISSING_SWITCH_NAME = "missing-switch-name"
    BAD_NAME = "bad-name"
    BAD_LINK_SPEED = "bad-link-speed"
    BAD_HOSTLIST = "bad-hostlist"
    DUPLICATE_SWITCH = "duplicate-switch"
    BOTH_CHILDREN = "both-nodes-and-switches"
    NO_CHILDREN = "no-children"
    UNDEFINED_SWITCH = "undefined-switch"
    NODE_UNDER_TWO_LEAVES = "node-under-two-leaves"
    DUPLICATE_NODE = "duplicate-node"
    SWITCH_UNDER_TWO_PODS = "switch-under-two-pods"
    SWITCH_AT_TWO_LEVELS = "switch-at-two-levels"
    CYCLE = "cycle"
    EMPTY = "empty"
    BAD_BLOCK_SIZES = "bad-block-sizes"
    MIXED_PLUGINS = "tree-and-block-lines"


@dataclass(frozen=True, slots=True, kw_only=True)
class Problem:
    """One thing wrong with a topology source, printed as `FILE:LINE: what is wrong; fix`."""

    kind: ProblemKind
    source: str
    line: int  # 1-based; 0 when the problem has no single line
    message: str

    def __str__(self) -> str:
        if self.line > 0:
            return f"{self.source}:{self.line}: {self.message}"
        return f"{self.source}: {self.message}"


class TopologyProblems(TopologyError):
    """A topology source has one or more problems; `str()` has one `FILE:LINE:` line each."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems: tuple[Problem, ...] = sort_problems(problems)
        super().__init__("\n".join(str(p) for p in self.problems))

    def __reduce__(self) -> tuple[type[TopologyProblems], tuple[tuple[Problem, ...]]]:
        return type(self), (self.problems,)


def sort_problems(problems: Iterable[Problem]) -> tuple[Problem, ...]:
    """Problems in line order (stable for problems on the same line); duplicates dropped."""
    unique = dict.fromkeys(problems)
    return tuple(sorted(unique, key=lambda p: p.line))


@dataclass(frozen=True, slots=True, kw_only=True)
class Switch:
    """One switch: a leaf lists `nodes`, an upper switch lists child `switches` by name."""

    name: str
    nodes: tuple[str, ...] = ()
    switches: tuple[str, ...] = ()
    link_speed: int | None = None  # Slurm's LinkSpeed=; None when the source did not give one
    line: int = 0  # 1-based line of the definition in its source; 0 when built in code

    @property
    def is_leaf(self) -> bool:
        return not self.switches

    def same_content(self, other: Switch) -> bool:
        """True when both describe the same switch, wherever they were defined."""
        return (
            self.name == other.name
            and set(self.nodes) == set(other.nodes)
            and set(self.switches) == set(other.switches)
            and self.link_speed == other.link_speed
        )


SwitchShape = tuple[str, tuple[str, ...], tuple[str, ...], int | None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """A switch tree read from `source` in `format`."""

    switches: tuple[Switch, ...]
    source: str = "<memory>"
    format: TopologyFormat = TopologyFormat.MEMORY
    #: a block topology's BlockSizes= (base block size first); () when not given or not blocks
    block_sizes: tuple[int, ...] = ()

    def by_name(self) -> dict[str, Switch]:
        """Switches by name; the first definition wins where a name is defined twice."""
        out: dict[str, Switch] = {}
        for sw in self.switches:
            out.setdefault(sw.name, sw)
        return out

    def get(self, name: str) -> Switch | None:
        return self.by_name().get(name)

    def leaf_of(self) -> dict[str, str]:
        """The leaf switch of every node (the first one where a node is listed twice)."""
        out: dict[str, str] = {}
        for sw in self.switches:
            for node in sw.nodes:
                out.setdefault(node, sw.name)
        return out

    def nodes(self) -> list[str]:
        """Every node, each once, in file order."""
        return list(self.leaf_of())

    def parents(self) -> dict[str, list[str]]:
        """Child switch name -> names of the switches that list it, in file order."""
        out: dict[str, list[str]] = {}
        for sw in self.switches:
            for child in sw.switches:
                parents = out.setdefault(child, [])
                if sw.name not in parents:
                    parents.append(sw.name)
        return out

    def primary_parent(self) -> dict[str, str]:
        """Child switch name -> its first parent in file order."""
        return {child: parents[0] for child, parents in self.parents().items()}

    def shape(self) -> tuple[SwitchShape, ...]:
        """A comparable, order-free description: equal shapes mean the same tree."""
        return tuple(
            sorted(
                (
                    sw.name,
                    tuple(natural_sorted(set(sw.nodes))),
                    tuple(natural_sorted(set(sw.switches))),
                    sw.link_speed,
                )
                for sw in self.switches
            )
        )

    def with_switches(self, switches: Iterable[Switch]) -> Topology:
        """A copy with other switches and the same source, format and block sizes."""
        return Topology(
            switches=tuple(switches),
            source=self.source,
            format=self.format,
            block_sizes=self.block_sizes,
        )


def switch_levels(topology: Topology) -> dict[str, int]:
    """Slurm's switch levels: 0 for a leaf, else one more than its highest defined child.

    Total on any input: switches on a cycle get the level reached before the cycle closes.
    """
    by_name = topology.by_name()
    levels: dict[str, int] = {}
    for start in by_name:
        if start in levels:
            continue
        # Iterative post-order walk; `active` guards against cycles.
        stack: list[tuple[str, bool]] = [(start, False)]
        active: set[str] = set()
        while stack:
            name, expanded = stack.pop()
            if name in levels:
                continue
            kids = [c for c in by_name[name].switches if c in by_name]
            if expanded:
                active.discard(name)
                levels[name] = 1 + max((levels.get(c, 0) for c in kids), default=-1)
                continue
            if name in active:
                continue
            active.add(name)
            stack.append((name, True))
            stack.extend((c, False) for c in kids if c not in levels and c not in active)
    return levels


def check(topology: Topology) -> list[Problem]:
    """Structural problems of a parsed topology (the parsers report syntax problems)."""
    src = topology.source
    problems: list[Problem] = []
    if not topology.switches:
        problems.append(
            Problem(
                kind=ProblemKind.EMPTY,
                source=src,
                line=0,
                message="no switches defined; add lines like 'SwitchName=leaf0 Nodes=node[1-4]'"
                " and 'SwitchName=spine0 Switches=leaf[0-1]'",
            )
        )
        return problems
    problems.extend(_check_switch_records(topology))
    problems.extend(_check_nodes(topology))
    problems.extend(_check_cycles(topology))
    return problems


def _check_switch_records(topology: Topology) -> list[Problem]:
    src = topology.source
    problems: list[Problem] = []
    first: dict[str, Switch] = {}
    for sw in topology.switches:
        earlier = first.setdefault(sw.name, sw)
        if earlier is not sw:
            problems.append(
                Problem(
                    kind=ProblemKind.DUPLICATE_SWITCH,
                    source=src,
                    line=sw.line,
                    message=f"switch '{sw.name}' is already defined on line {earlier.line};"
                    " a name defines one switch: rename one of them or merge the two lines",
                )
            )
        if sw.nodes and sw.switches:
            problems.append(
                Problem(
                    kind=ProblemKind.BOTH_CHILDREN,
                    source=src,
                    line=sw.line,
                    message=f"switch '{sw.name}' has both Nodes= and Switches=; Slurm's tree"
                    " plugin rejects that: put the nodes under a leaf switch of their own and"
                    " list that leaf in Switches=",
                )
            )
        if not sw.nodes and not sw.switches:
            problems.append(
                Problem(
                    kind=ProblemKind.NO_CHILDREN,
                    source=src,
                    line=sw.line,
                    message=f"switch '{sw.name}' has neither Nodes= nor Switches=; add"
                    " Nodes=HOSTLIST for a leaf switch or Switches=NAMES for an upper switch",
                )
            )
    for sw in topology.switches:
        for child in sw.switches:
            if child not in first:
                problems.append(
                    Problem(
                        kind=ProblemKind.UNDEFINED_SWITCH,
                        source=src,
                        line=sw.line,
                        message=f"switch '{child}' is used by '{sw.name}' but never defined;"
                        f" add 'SwitchName={child} Nodes=...' or remove it from Switches=",
                    )
                )
    return problems


def _check_nodes(topology: Topology) -> list[Problem]:
    src = topology.source
    problems: list[Problem] = []
    seen: dict[str, Switch] = {}
    for sw in topology.switches:
        for node in sw.nodes:
            earlier = seen.setdefault(node, sw)
            if earlier is sw:
                continue
            kind = ProblemKind.NODE_UNDER_TWO_LEAVES
            if earlier.name == sw.name:
                kind = ProblemKind.DUPLICATE_NODE
                message = (
                    f"node '{node}' is listed again under switch '{sw.name}' (also on line"
                    f" {earlier.line}); list each node once"
                )
            else:
                message = (
                    f"node '{node}' is under two leaf switches, '{earlier.name}' (line"
                    f" {earlier.line}) and '{sw.name}'; a node hangs off one leaf: remove it"
                    f" from one of them"
                )
            problems.append(Problem(kind=kind, source=src, line=sw.line, message=message))
    return problems


def _check_cycles(topology: Topology) -> list[Problem]:
    """One problem per cycle in the child-switch graph, at the line that closes it."""
    by_name = topology.by_name()
    done: set[str] = set()
    problems: list[Problem] = []
    reported: set[frozenset[str]] = set()
    for start in by_name:
        if start in done:
            continue
        path: list[str] = []
        on_path: dict[str, int] = {}
        # Each frame: (switch name, iterator position over its children).
        stack: list[tuple[str, int]] = [(start, 0)]
        while stack:
            name, pos = stack.pop()
            if pos == 0:
                on_path[name] = len(path)
                path.append(name)
            kids = by_name[name].switches
            if pos < len(kids):
                stack.append((name, pos + 1))
                child = kids[pos]
                if child not in by_name or child in done:
                    continue
                if child in on_path:
                    cycle = [*path[on_path[child] :], child]
                    members = frozenset(cycle)
                    if members not in reported:
                        reported.add(members)
                        problems.append(_cycle_problem(topology, by_name[name], cycle))
                    continue
                stack.append((child, 0))
            else:
                path.pop()
                del on_path[name]
                done.add(name)
    return problems


def _cycle_problem(topology: Topology, closer: Switch, cycle: list[str]) -> Problem:
    arrow = " -> ".join(cycle)
    child = cycle[-1]
    if len(cycle) == 2:
        what = f"switch '{child}' lists itself in Switches="
    else:
        what = f"switch cycle {arrow} (each switch lists the next in Switches=)"
    return Problem(
        kind=ProblemKind.CYCLE,
        source=topology.source,
        line=closer.line,
        message=f"{what}; a switch cannot be below itself: remove '{child}' from Switches= of"
        f" '{closer.name}'",
    )
