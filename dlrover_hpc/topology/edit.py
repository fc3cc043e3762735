"""Editing a topology file: pure operations on the model, then a comment-keeping rewrite.

Each operation takes a valid `Topology` and returns an `EditResult` or raises TopologyError
saying what is wrong and how to fix it. `edit_file` validates the file first, applies one
operation, rewrites only the lines that changed (comments and untouched lines stay as they
are), reads the result back to prove it says what was meant, and replaces the file atomically.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dlrover_hpc.errors import TopologyError
from dlrover_hpc.topology.blocks import check_blocks, format_block_line
from dlrover_hpc.topology.files import read_text, scan, write_atomic
from dlrover_hpc.topology.model import (
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    bad_name_reason,
    check,
    natural_sorted,
)
from dlrover_hpc.topology.order import rank_order
from dlrover_hpc.topology.slurm_conf import compress, format_switch_line, logical_lines
from dlrover_hpc.topology.switch_list import scan_entries, switch_list_rows

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class EditResult:
    topology: Topology
    summary: str  # one line for the user: what changed


Operation = Callable[[Topology], EditResult]


def _fail(topology: Topology, message: str, line: int = 0) -> TopologyError:
    where = f"{topology.source}:{line}" if line else topology.source
    return TopologyError(f"{where}: {message}")


def _choices(names: Sequence[str], limit: int = 8) -> str:
    shown = natural_sorted(names)
    more = f", ... ({len(shown) - limit} more)" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more if shown else "(none)"


def _leaf(topology: Topology, name: str) -> Switch:
    sw = topology.get(name)
    leaves = [s.name for s in topology.switches if s.is_leaf]
    if sw is None:
        raise _fail(
            topology,
            f"no switch '{name}'; pick a leaf switch ({_choices(leaves)}) or create it with"
            f" add-switch {name} --nodes HOSTLIST --parent SWITCH",
        )
    if not sw.is_leaf:
        raise _fail(
            topology,
            f"switch '{name}' has child switches, and nodes go under a leaf switch; pick one of:"
            f" {_choices(leaves)}",
            sw.line,
        )
    return sw


def _check_new_names(topology: Topology, names: Sequence[str], what: str) -> None:
    for name in names:
        reason = bad_name_reason(name)
        if reason:
            raise _fail(topology, f"{what} '{name}' is not a valid name ({reason})")


def _replace_switches(topology: Topology, changed: dict[str, Switch | None]) -> Topology:
    """A copy where each named switch is replaced (or removed, for None), in place."""
    out = []
    for sw in topology.switches:
        if sw.name not in changed:
            out.append(sw)
        elif (new := changed[sw.name]) is not None:
            out.append(new)
    return topology.with_switches(out)


def add_nodes(topology: Topology, hosts: Sequence[str], *, switch: str) -> EditResult:
    """Put new `hosts` under leaf `switch`."""
    _check_new_names(topology, hosts, "node")
    leaf = _leaf(topology, switch)
    leaf_of = topology.leaf_of()
    by_name = topology.by_name()
    for host in hosts:
        if host in leaf_of:
            where = by_name[leaf_of[host]]
            raise _fail(
                topology,
                f"node '{host}' is already under '{where.name}'; use move-node to move it",
                where.line,
            )
    new_leaf = replace(leaf, nodes=(*leaf.nodes, *natural_sorted(dict.fromkeys(hosts))))
    return EditResult(
        topology=_replace_switches(topology, {leaf.name: new_leaf}),
        summary=f"added {compress(list(hosts))} to {leaf.name}",
    )


def _current_leaves(topology: Topology, hosts: Sequence[str], verb: str) -> dict[str, str]:
    leaf_of = topology.leaf_of()
    for host in hosts:
        if host not in leaf_of:
            fix = "add it with add-node" if verb == "move" else "nothing to remove"
            raise _fail(topology, f"node '{host}' is not in the file; {fix}")
    return {host: leaf_of[host] for host in hosts}


def _take_nodes(topology: Topology, current: dict[str, str], verb: str) -> dict[str, Switch | None]:
    """The leaves that lose `current`'s hosts, without them; refuses to empty a leaf."""
    by_name = topology.by_name()
    changed: dict[str, Switch | None] = {}
    for leaf_name in dict.fromkeys(current.values()):
        leaf = by_name[leaf_name]
        kept = tuple(n for n in leaf.nodes if current.get(n) != leaf_name)
        if not kept and not topology.format.is_block:  # an empty block is a placeholder
            raise _fail(
                topology,
                f"{verb} would leave switch '{leaf_name}' with no nodes, and an empty switch is"
                f" invalid; remove the switch (remove-switch {leaf_name}) or give it another"
                " node first",
                leaf.line,
            )
        changed[leaf_name] = replace(leaf, nodes=kept)
    return changed


def move_nodes(topology: Topology, hosts: Sequence[str], *, switch: str) -> EditResult:
    """Move existing `hosts` under leaf `switch`; hosts already there stay."""
    target = _leaf(topology, switch)
    current = _current_leaves(topology, hosts, "move")
    moving = {h: leaf for h, leaf in current.items() if leaf != target.name}
    if not moving:
        return EditResult(topology=topology, summary=f"nothing to do: already under {switch}")
    changed = _take_nodes(topology, moving, "moving them")
    changed[target.name] = replace(target, nodes=(*target.nodes, *natural_sorted(moving)))
    return EditResult(
        topology=_replace_switches(topology, changed),
        summary=f"moved {compress(list(moving))} to {target.name}",
    )


def remove_nodes(topology: Topology, hosts: Sequence[str]) -> EditResult:
    """Take existing `hosts` out of the file."""
    current = _current_leaves(topology, hosts, "remove")
    changed = _take_nodes(topology, current, "removing them")
    return EditResult(
        topology=_replace_switches(topology, changed),
        summary=f"removed {compress(list(current))}",
    )


def add_switch(
    topology: Topology,
    name: str,
    *,
    nodes: Sequence[str] = (),
    switches: Sequence[str] = (),
    parent: str | None = None,
    link_speed: int | None = None,
) -> EditResult:
    """Add switch `name` over new `nodes` (a leaf) or existing `switches`, under `parent`.

    In a block file a "switch" is a block: it takes --nodes (or none) and no parent."""
    _check_new_names(topology, [name], "switch")
    if topology.format.is_block and (switches or parent is not None):
        raise _fail(
            topology,
            f"a block file has blocks only, no switches above them; add block '{name}' with"
            " --nodes HOSTLIST (no --switches, no --parent)",
        )
    by_name = topology.by_name()
    if name in by_name:
        raise _fail(
            topology, f"switch '{name}' already exists; pick another name", by_name[name].line
        )
    if bool(nodes) == bool(switches) and not topology.format.is_block:
        raise _fail(topology, f"give switch '{name}' either --nodes HOSTLIST or --switches NAMES")
    if link_speed is not None and link_speed < 0:
        raise _fail(topology, f"--link-speed {link_speed} is negative; give a whole number >= 0")
    _check_new_names(topology, nodes, "node")
    leaf_of = topology.leaf_of()
    for host in nodes:
        if host in leaf_of:
            raise _fail(
                topology,
                f"node '{host}' is already under '{leaf_of[host]}'; move it later with move-node,"
                " or leave it out of --nodes",
                by_name[leaf_of[host]].line,
            )
    for child in switches:
        if child not in by_name:
            raise _fail(
                topology,
                f"no switch '{child}' to put under '{name}'; existing switches:"
                f" {_choices(list(by_name))}",
            )
    changed: dict[str, Switch | None] = {}
    if parent is not None:
        up = by_name.get(parent)
        uppers = [s.name for s in topology.switches if not s.is_leaf]
        if up is None or up.is_leaf:
            problem = "no switch" if up is None else "leaf switch"
            raise _fail(
                topology,
                f"{problem} '{parent}' to hold '{name}'; a parent must be a switch with child"
                f" switches: {_choices(uppers)}",
                up.line if up else 0,
            )
        changed[parent] = replace(up, switches=(*up.switches, name))
    new = Switch(
        name=name,
        nodes=tuple(natural_sorted(dict.fromkeys(nodes))),
        switches=tuple(dict.fromkeys(switches)),
        link_speed=link_speed,
    )
    edited = _replace_switches(topology, changed)
    edited = edited.with_switches([*edited.switches, new])
    below = f"over {compress(list(nodes))}" if nodes else f"over {compress(list(switches))}"
    under = f" under {parent}" if parent else ""
    return EditResult(topology=edited, summary=f"added switch {name} {below}{under}")


def remove_switch(topology: Topology, name: str) -> EditResult:
    """Remove switch `name` with everything only reachable through it."""
    by_name = topology.by_name()
    if name not in by_name:
        raise _fail(topology, f"no switch '{name}'; existing switches: {_choices(list(by_name))}")
    parents = topology.parents()
    removed = {name}
    grew = True
    while grew:
        grew = False
        for sw in topology.switches:
            if sw.name in removed:
                continue
            its = parents.get(sw.name, [])
            if its and all(p in removed for p in its):
                removed.add(sw.name)
                grew = True
    changed: dict[str, Switch | None] = dict.fromkeys(removed)
    for parent_name in parents.get(name, []):
        if parent_name in removed:
            continue
        up = by_name[parent_name]
        kept = tuple(c for c in up.switches if c != name)
        if not kept:
            raise _fail(
                topology,
                f"removing '{name}' would leave switch '{parent_name}' with no children, and an"
                f" empty switch is invalid; remove '{parent_name}' instead (it takes '{name}'"
                " with it)",
                up.line,
            )
        changed[parent_name] = replace(up, switches=kept)
    gone_nodes = [n for s in removed for n in by_name[s].nodes]
    summary = f"removed switch{'es' if len(removed) > 1 else ''} {compress(list(removed))}"
    if gone_nodes:
        summary += f" and node{'s' if len(gone_nodes) > 1 else ''} {compress(gone_nodes)}"
    return EditResult(topology=_replace_switches(topology, changed), summary=summary)


def render_edit(text: str, old: Topology, new: Topology) -> str:
    """`text` (which parsed to `old`) rewritten to say `new`, changing as few lines as can be."""
    newline = "\r\n" if "\r\n" in text else "\n"
    if old.format is TopologyFormat.SWITCH_LIST:
        lines = _edit_switch_list(text, old, new)
    elif old.format is TopologyFormat.BLOCK:
        lines = _edit_slurm_conf(text, old, new, line_of=format_block_line)
    else:
        lines = _edit_slurm_conf(text, old, new)
    return newline.join(lines) + newline if lines else ""


def _edit_slurm_conf(
    text: str,
    old: Topology,
    new: Topology,
    *,
    line_of: Callable[[Switch], str] = format_switch_line,
) -> list[str]:
    physical = text.splitlines()
    spans = {ll.first: ll for ll in logical_lines(text)}
    new_by_name = new.by_name()
    plan: dict[int, tuple[list[str], int]] = {}  # first line -> (replacement, last line)
    for sw in old.switches:
        ll = spans[sw.line]
        after = new_by_name.get(sw.name)
        if after is None:
            plan[ll.first] = ([], ll.last)
        elif not sw.same_content(after):
            comment = f"  {ll.comment}" if ll.comment else ""
            plan[ll.first] = ([line_of(after) + comment], ll.last)
    out: list[str] = []
    number = 1
    while number <= len(physical):
        if number in plan:
            lines, last = plan[number]
            out.extend(lines)
            number = last + 1
        else:
            out.append(physical[number - 1])
            number += 1
    old_names = old.by_name()
    out.extend(line_of(sw) for sw in new.switches if sw.name not in old_names)
    return out


def _edit_switch_list(text: str, old: Topology, new: Topology) -> list[str]:
    rows, losses = switch_list_rows(new)
    if losses:
        raise _fail(
            old,
            f"a switch list cannot hold this change ({losses[0]}); convert the file to"
            " topology.conf first (convert --to slurm)",
        )
    place = {host: (asw, psw) for asw, psw, host in rows}
    entries, _ = scan_entries(text, source=old.source)
    width_asw = max([len(r[0]) for r in rows] + [len(e.asw) for e in entries], default=0)
    width_psw = max([len(r[1]) for r in rows] + [len(e.psw) for e in entries], default=0)

    def row(asw: str, psw: str, host: str, comment: str = "") -> str:
        line = f"{asw:<{width_asw}}  {psw:<{width_psw}}  {host}"
        return f"{line}  {comment}" if comment else line

    by_line = {e.line: e for e in entries}
    out: list[tuple[str, str | None]] = []  # (text, ASW of the line or None)
    for number, raw in enumerate(text.splitlines(), start=1):
        e = by_line.get(number)
        if e is None:
            out.append((raw, None))
        elif e.host in place:
            asw, psw = place[e.host]
            same = (asw, psw) == (e.asw, e.psw)
            out.append((raw if same else row(asw, psw, e.host, e.comment), asw))
    known = {e.host for e in entries}
    for host in rank_order(new):
        if host in known:
            continue
        asw, psw = place[host]
        at = max((i for i, (_, a) in enumerate(out) if a == asw), default=len(out) - 1)
        out.insert(at + 1, (row(asw, psw, host), asw))
    return [line for line, _ in out]


def edit_file(
    path: str | os.PathLike[str], operation: Operation, *, create: bool = False
) -> EditResult:
    """Validate the file, apply `operation`, write the result atomically; returns the result.

    With `create`, a missing or empty file counts as an empty topology.conf (for add-switch).
    """
    name = os.fspath(path)
    if create and not Path(name).exists():
        text, source = "", name
    else:
        text, source = read_text(name)
    old, problems = scan(text, source=source)
    blocking = [p for p in problems if not (create and p.kind is ProblemKind.EMPTY)]
    if blocking:
        listing = "\n".join(str(p) for p in blocking)
        raise TopologyError(
            f"{source}: not edited because the file has problems; fix them first (see"
            f" `dlrover-hpc topology validate {source}`):\n{listing}"
        )
    if old.format in (TopologyFormat.SCONTROL, TopologyFormat.SCONTROL_BLOCK):
        to = "block" if old.format.is_block else "slurm"
        raise TopologyError(
            f"{source}: this is saved `scontrol show topology` output; write a {to} file"
            f" from it first (convert {source} --to {to} --output FILE) and edit that"
        )
    result = operation(old)
    if result.topology is old:
        return result
    new_problems = (check_blocks if old.format.is_block else check)(result.topology)
    if new_problems:
        raise TopologyError("\n".join(str(p) for p in new_problems))
    out = render_edit(text, old, result.topology)
    reread, again = scan(out, source=source)
    if again or reread.shape() != result.topology.shape():
        raise TopologyError(
            f"{source}: internal error: the edited text would not read back as intended, so the"
            " file was left unchanged; please report this with the file attached"
        )
    write_atomic(name, out)
    logger.info("topology_file_edited path=%s change=%r", name, result.summary)
    return result
