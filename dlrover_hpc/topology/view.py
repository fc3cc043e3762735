"""A tree view of a topology for `dlrover-hpc topology show` (plain ASCII, deterministic)."""

from __future__ import annotations

from dlrover_hpc.topology.blocks import render_blocks
from dlrover_hpc.topology.model import Topology, natural_key, natural_sorted, switch_levels
from dlrover_hpc.topology.slurm_conf import compress

_MAX_INLINE_NODES = 2000  # longer node lists are summarised by their count


def render_tree(topology: Topology) -> str:
    """The switches as a tree, in rank order; a leaf shows its nodes as a hostlist.

    A switch listed under several parents appears in full under its first parent and as
    `NAME (see PARENT)` under the others. A block topology is listed block by block.
    """
    if topology.format.is_block:
        return render_blocks(topology)
    by_name = topology.by_name()
    parents = topology.parents()
    primary = topology.primary_parent()
    levels = switch_levels(topology)
    n_nodes = len(topology.leaf_of())
    depth = max(levels.values(), default=-1) + 1
    lines = [
        f"{topology.source}: {len(by_name)} switch{'es' if len(by_name) != 1 else ''},"
        f" {n_nodes} node{'s' if n_nodes != 1 else ''}, {depth} level{'s' if depth != 1 else ''}"
        f" ({topology.format.value})"
    ]
    children: dict[str, list[str]] = {name: [] for name in by_name}
    for child, its_parents in parents.items():
        for up in its_parents:
            if child in by_name and up in by_name and child != up:
                children[up].append(child)
    for kids in children.values():
        kids.sort(key=natural_key)
    roots = natural_sorted(n for n in by_name if n not in primary)
    shown: set[str] = set()
    # Stack entries: (switch name, prefix for its line, prefix for its children, parent).
    # Roots first; then any switch not shown yet (one reached only through a cycle).
    stack: list[tuple[str, str, str, str | None]] = [
        (name, "", "", None) for name in [*reversed(natural_sorted(by_name)), *reversed(roots)]
    ]
    while stack:
        name, lead, indent, parent = stack.pop()
        if parent is None and name in shown:
            continue
        if name in shown or (parent is not None and primary.get(name) != parent):
            lines.append(f"{lead}{name} (see {primary.get(name, '?')})")
            continue
        shown.add(name)
        sw = by_name[name]
        lines.append(lead + _describe(sw.name, sw.nodes, sw.link_speed))
        kids = children[name]
        for i in reversed(range(len(kids))):
            last = i == len(kids) - 1
            stack.append(
                (
                    kids[i],
                    indent + ("`-- " if last else "|-- "),
                    indent + ("    " if last else "|   "),
                    name,
                )
            )
    return "\n".join(lines) + "\n"


def _describe(name: str, nodes: tuple[str, ...], link_speed: int | None) -> str:
    speed = f" [LinkSpeed={link_speed}]" if link_speed is not None else ""
    if not nodes:
        return f"{name}{speed}"
    count = f"{len(nodes)} node{'s' if len(nodes) != 1 else ''}"
    if len(nodes) > _MAX_INLINE_NODES:
        return f"{name}{speed} ({count})"
    return f"{name}{speed} ({count}): {compress(nodes)}"
