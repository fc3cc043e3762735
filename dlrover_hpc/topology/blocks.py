"""Slurm's block topology (topology/block plugin): block.conf lines and `scontrol` output.

A block file (Slurm reads these lines from topology.conf under `TopologyPlugin=topology/block`;
sites often keep them as block.conf) has one block per line and one `BlockSizes=` line::

    BlockName=block1 Nodes=node[1-32]
    BlockSizes=30,120

Keys are case-insensitive, `#` starts a comment, values are Slurm hostlists (the syntax of
`slurm_conf.py`). `BlockSizes=` lists the base block size and the enforced aggregated sizes,
each a power of two times the one before (topology.conf(5)). A block may list fewer nodes than
the base size or none at all (Slurm 25.05 allows incomplete and placeholder blocks).

Under the block plugin `scontrol show topology` prints each base block and each aggregated
block (`src/plugins/topology/block/topology_block.c`, `_print_topo_record`)::

    BlockName=block01 BlockIndex=0 Nodes=node[0001-0018] BlockSize=18
    AggregatedBlock=gb300_b[0-1] BlockIndex=2 Nodes=... BlockSize=4

In the model each block is a leaf `Switch` with no switch above it, so `order` keeps a block's
nodes contiguous and puts the blocks in natural order.
"""

from __future__ import annotations

import difflib
import itertools
import re
import shlex

from dlrover_hpc.topology.model import (
    Problem,
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    bad_name_reason,
    natural_key,
    natural_sorted,
    sort_problems,
)
from dlrover_hpc.topology.slurm_conf import (
    compress,
    expand_names,
    logical_lines,
)

KEYS = {"blockname": "BlockName", "nodes": "Nodes", "blocksizes": "BlockSizes"}
_TREE_KEYS = {"switchname", "switches", "linkspeed"}
BLOCK_KEY = re.compile(r"^\s*\"?(BlockName|BlockSizes)\s*=", re.IGNORECASE)
SCONTROL_BLOCK_KEY = re.compile(r"^\s*(BlockName|AggregatedBlock)=\S*\s+BlockIndex=", re.IGNORECASE)
_MIXED_FIX = (
    "Slurm reads one plugin's lines: keep the BlockName= lines for TopologyPlugin=topology/block"
    " or the SwitchName= lines for topology/tree, one file each"
)


def _problem(kind: ProblemKind, source: str, line: int, message: str) -> Problem:
    return Problem(kind=kind, source=source, line=line, message=message)


def scan_block_conf(text: str, *, source: str) -> tuple[Topology, list[Problem]]:
    """Parse block.conf text; returns what could be parsed and every problem found."""
    blocks: list[Switch] = []
    problems: list[Problem] = []
    sizes: tuple[int, ...] = ()
    sizes_line = 0
    for ll in logical_lines(text):
        if not ll.text:
            continue
        values, line_problems = _key_values(ll.text, source, ll.first)
        problems.extend(line_problems)
        if "BlockSizes" in values:
            if "BlockName" in values or "Nodes" in values:
                problems.append(
                    _problem(
                        ProblemKind.BAD_SYNTAX,
                        source,
                        ll.first,
                        "BlockSizes= goes on a line of its own; move it off this BlockName= line",
                    )
                )
            elif sizes_line:
                problems.append(
                    _problem(
                        ProblemKind.DUPLICATE_KEY,
                        source,
                        ll.first,
                        f"BlockSizes= is already given on line {sizes_line}; give it once",
                    )
                )
            else:
                sizes_line = ll.first
                parsed, problem = _block_sizes(values["BlockSizes"], source, ll.first)
                sizes = parsed
                problems.extend([problem] if problem else [])
            continue
        block = _block(values, source, ll.first, problems, line_problems)
        if block is not None:
            blocks.append(block)
    topology = Topology(
        switches=tuple(blocks), source=source, format=TopologyFormat.BLOCK, block_sizes=sizes
    )
    problems.extend(check_blocks(topology, empty_ok=bool(problems)))
    return topology, list(sort_problems(problems))


def _key_values(text: str, source: str, line: int) -> tuple[dict[str, str], list[Problem]]:
    try:
        tokens = shlex.split(text, comments=False, posix=True)
    except ValueError as exc:
        message = f"cannot split the line ({exc}); close the quote"
        return {}, [_problem(ProblemKind.BAD_SYNTAX, source, line, message)]
    values: dict[str, str] = {}
    problems: list[Problem] = []
    for token in tokens:
        key, eq, value = token.partition("=")
        lower = key.lower()
        if not eq or not key:
            message = (
                f"'{token}' is not KEY=VALUE; write 'BlockName=NAME Nodes=HOSTLIST' with"
                " hostlists free of blanks (Nodes=node1,node2)"
            )
            if lower == "include":
                message = "'Include' is not supported here; paste the included file's lines"
            problems.append(_problem(ProblemKind.BAD_SYNTAX, source, line, message))
            break
        if lower in _TREE_KEYS:
            problems.append(
                _problem(
                    ProblemKind.MIXED_PLUGINS,
                    source,
                    line,
                    f"'{key}=' is a tree-plugin key in a block topology; {_MIXED_FIX}",
                )
            )
            continue
        if lower not in KEYS:
            close = difflib.get_close_matches(lower, list(KEYS), n=1)
            hint = f"did you mean '{KEYS[close[0]]}='? " if close else ""
            problems.append(
                _problem(
                    ProblemKind.UNKNOWN_KEY,
                    source,
                    line,
                    f"unknown key '{key}'; {hint}a block line takes BlockName= and Nodes=,"
                    " and one line takes BlockSizes=",
                )
            )
            continue
        canonical = KEYS[lower]
        if canonical in values:
            problems.append(
                _problem(
                    ProblemKind.DUPLICATE_KEY,
                    source,
                    line,
                    f"'{canonical}=' is given twice on this line; give it once",
                )
            )
            continue
        if not value and canonical != "Nodes":
            problems.append(
                _problem(ProblemKind.BAD_SYNTAX, source, line, f"'{key}=' has no value; give one")
            )
            continue
        values[canonical] = value
    return values, problems


def _block_sizes(value: str, source: str, line: int) -> tuple[tuple[int, ...], Problem | None]:
    """BlockSizes=N[,N...]: whole numbers > 0, each a power of two (2, 4, ...) times the last."""
    parts = value.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        return (), _problem(
            ProblemKind.BAD_BLOCK_SIZES,
            source,
            line,
            f"BlockSizes={value} is not a list of whole numbers above 0; write e.g."
            " BlockSizes=18 or BlockSizes=18,36,72",
        )
    sizes = tuple(int(p) for p in parts)
    for low, high in itertools.pairwise(sizes):
        ratio, rest = divmod(high, low)
        if rest or ratio < 2 or ratio & (ratio - 1):
            return sizes, _problem(
                ProblemKind.BAD_BLOCK_SIZES,
                source,
                line,
                f"BlockSizes={value}: {high} is not a power of two (2, 4, 8, ...) times {low};"
                f" Slurm aggregates blocks in pairs: write e.g. BlockSizes={low},{low * 2}",
            )
    return sizes, None


def _block(
    values: dict[str, str],
    source: str,
    line: int,
    problems: list[Problem],
    line_problems: list[Problem],
) -> Switch | None:
    name = values.get("BlockName")
    if name is None:
        if not line_problems:
            problems.append(
                _problem(
                    ProblemKind.MISSING_SWITCH_NAME,
                    source,
                    line,
                    "no BlockName= on this line; each line defines one block: start it with"
                    " BlockName=NAME (or write BlockSizes=N,... alone on a line)",
                )
            )
        return None
    reason = bad_name_reason(name)
    if reason:
        problems.append(
            _problem(
                ProblemKind.BAD_NAME,
                source,
                line,
                f"block name '{name}' is not one name ({reason}); BlockName= takes one name:"
                " write one line per block",
            )
        )
        return None
    nodes = _nodes(values.get("Nodes", ""), source, line, problems)
    return Switch(name=name, nodes=nodes, line=line)


def _nodes(value: str, source: str, line: int, problems: list[Problem]) -> tuple[str, ...]:
    """A block's Nodes= hostlist, checked as topology.conf's are (:func:`expand_names`)."""

    def problem(kind: ProblemKind, message: str) -> Problem:
        return _problem(kind, source, line, message)

    return expand_names(value or None, "Nodes", problem, problems)


def check_blocks(topology: Topology, *, empty_ok: bool = False) -> list[Problem]:
    """Structural problems of a block topology: no blocks, a name twice, a node in two."""
    src = topology.source
    if not topology.switches:
        if empty_ok:
            return []
        return [
            _problem(
                ProblemKind.EMPTY,
                src,
                0,
                "no blocks defined; add lines like 'BlockName=block1 Nodes=node[1-18]' and"
                " 'BlockSizes=18'",
            )
        ]
    problems: list[Problem] = []
    first: dict[str, Switch] = {}
    owner: dict[str, Switch] = {}
    for block in topology.switches:
        earlier = first.setdefault(block.name, block)
        if earlier is not block:
            problems.append(
                _problem(
                    ProblemKind.DUPLICATE_SWITCH,
                    src,
                    block.line,
                    f"block '{block.name}' is already defined on line {earlier.line}; rename"
                    " one of them or merge their Nodes= lists",
                )
            )
        for node in block.nodes:
            other = owner.setdefault(node, block)
            if other is block:
                continue
            if other.name == block.name:
                message = f"node '{node}' is listed twice in block '{block.name}'; list it once"
            else:
                message = (
                    f"node '{node}' is in block '{other.name}' (line {other.line}) and in block"
                    f" '{block.name}'; a node belongs to one block: remove it from one of them"
                )
            problems.append(_problem(ProblemKind.NODE_UNDER_TWO_LEAVES, src, block.line, message))
    return problems


def parse_scontrol_blocks(text: str, *, source: str) -> Topology:
    """Parse `scontrol show topology` output of the block plugin; raises TopologyProblems.

    Base blocks (`BlockName=`) become the blocks; `AggregatedBlock=` lines are Slurm's pairs of
    them and add nothing but their `BlockSize=`, which with the base size gives `block_sizes`.
    Keys other than the four printed by Slurm are ignored (newer releases may add some).
    """
    blocks: list[Switch] = []
    sizes: set[int] = set()
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        fields: dict[str, str] = {}
        for token in raw.split():
            key, eq, value = token.partition("=")
            if not eq:
                problems.append(_bad_scontrol(source, number, raw, f"'{token}' is not KEY=VALUE"))
                break
            fields[key.lower()] = "" if value == "(null)" else value
        else:
            block = _scontrol_record(fields, source, number, raw, sizes, problems)
            if block is not None:
                blocks.append(block)
    topology = Topology(
        switches=tuple(blocks),
        source=source,
        format=TopologyFormat.SCONTROL_BLOCK,
        block_sizes=tuple(sorted(sizes)),
    )
    problems.extend(check_blocks(topology, empty_ok=bool(problems)))
    if problems:
        raise TopologyProblems(problems)
    return topology


def _bad_scontrol(source: str, number: int, raw: str, why: str) -> Problem:
    return _problem(
        ProblemKind.BAD_SYNTAX,
        source,
        number,
        f"cannot read '{raw.strip()}': {why}; expected block-plugin lines like"
        " 'BlockName=b1 BlockIndex=0 Nodes=node[1-18] BlockSize=18'",
    )


def _scontrol_record(
    fields: dict[str, str],
    source: str,
    number: int,
    raw: str,
    sizes: set[int],
    problems: list[Problem],
) -> Switch | None:
    if "switchname" in fields:
        problems.append(
            _problem(
                ProblemKind.MIXED_PLUGINS,
                source,
                number,
                f"a tree-plugin line (SwitchName=) in block-plugin output; {_MIXED_FIX}",
            )
        )
        return None
    size = fields.get("blocksize", "")
    if not size.isdigit():
        problems.append(_bad_scontrol(source, number, raw, f"BlockSize='{size}' is not a number"))
        return None
    sizes.add(int(size))
    if "aggregatedblock" in fields:
        return None
    name = fields.get("blockname", "")
    if bad_name_reason(name):
        problems.append(_bad_scontrol(source, number, raw, "no usable BlockName="))
        return None
    nodes = _nodes(fields.get("nodes", ""), source, number, problems)
    return Switch(name=name, nodes=nodes, line=number)


def format_block_line(block: Switch) -> str:
    """One block.conf line for `block` (no newline)."""
    nodes = f" Nodes={compress(block.nodes)}" if block.nodes else ""
    return f"BlockName={block.name}{nodes}"


def render_block_conf(topology: Topology, *, header: str = "") -> str:
    """block.conf text: one line per block in natural order, then BlockSizes= where known.

    From a tree topology each leaf switch becomes a block (see `block_losses`)."""
    lines = [f"# {h}".rstrip() for h in header.splitlines()]
    for block in sorted(_leaves(topology), key=lambda b: natural_key(b.name)):
        lines.append(format_block_line(block))
    if topology.block_sizes:
        lines.append("BlockSizes=" + ",".join(str(n) for n in topology.block_sizes))
    return "\n".join(lines) + "\n"


def _leaves(topology: Topology) -> list[Switch]:
    return [sw for sw in topology.switches if not sw.switches]


def block_losses(topology: Topology) -> list[str]:
    """What a block file cannot say about `topology` (a tree's upper switches, link speeds)."""
    losses = [
        f"switch '{sw.name}' is above the leaf switches; a block file has no place for it"
        " (its leaves become blocks)"
        for sw in topology.switches
        if sw.switches
    ]
    losses += [
        f"LinkSpeed={sw.link_speed} of switch '{sw.name}' is dropped"
        for sw in topology.switches
        if sw.link_speed is not None
    ]
    return losses


def render_blocks(topology: Topology) -> str:
    """`topology show` for a block topology: a summary line, then each block in rank order."""
    blocks = sorted(topology.switches, key=lambda b: natural_key(b.name))
    n_nodes = len(topology.leaf_of())
    sizes = ",".join(str(n) for n in topology.block_sizes) or "not given"
    lines = [
        f"{topology.source}: {len(blocks)} block{'s' if len(blocks) != 1 else ''}, {n_nodes}"
        f" node{'s' if n_nodes != 1 else ''}, BlockSizes={sizes} ({topology.format.value})"
    ]
    base = topology.block_sizes[0] if topology.block_sizes else 0
    for block in blocks:
        count = len(block.nodes)
        short = f", {base - count} short of BlockSizes {base}" if count < base else ""
        nodes = f": {compress(natural_sorted(block.nodes))}" if block.nodes else ""
        lines.append(f"{block.name} ({count} node{'s' if count != 1 else ''}{short}){nodes}")
    return "\n".join(lines) + "\n"
