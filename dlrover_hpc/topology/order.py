"""Topology-aware node rank order (docs/design/architecture.md, topology order).

Pure and deterministic.

Rules: nodes under one leaf switch get adjacent ranks; leaves under one upper switch are adjacent
(recursively: every switch's subtree is one contiguous run); siblings, roots and the nodes of a
leaf go in natural order (node2 < node10); a switch with several parents is placed under its
first parent in file order; nodes absent from the topology go last, in natural order.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlrover_hpc.topology.model import Topology, natural_key, natural_sorted


def rank_order(topology: Topology) -> list[str]:
    """Every node of `topology`, each once, in rank order.

    Total on any input, even an unvalidated one: a switch is visited once (so a cycle ends the
    walk), a node listed twice keeps its first place, switches only reachable through a cycle
    are walked after the roots.
    """
    by_name = topology.by_name()
    children: dict[str, list[str]] = {name: [] for name in by_name}
    primary = topology.primary_parent()
    for child, parent in primary.items():
        if child in by_name and parent in by_name and child != parent:
            children[parent].append(child)
    for kids in children.values():
        kids.sort(key=natural_key)
    roots = natural_sorted(name for name in by_name if name not in primary)
    order: list[str] = []
    seen_nodes: set[str] = set()
    seen_switches: set[str] = set()
    for start in [*roots, *natural_sorted(by_name)]:
        if start in seen_switches:
            continue
        stack = [start]
        while stack:
            name = stack.pop()
            if name in seen_switches:
                continue
            seen_switches.add(name)
            for node in natural_sorted(by_name[name].nodes):
                if node not in seen_nodes:
                    seen_nodes.add(node)
                    order.append(node)
            stack.extend(reversed(children[name]))
    return order


def order_nodes(topology: Topology | None, hosts: Sequence[str]) -> tuple[list[str], list[str]]:
    """(hosts in rank order, hosts missing from the topology).

    Duplicates in `hosts` are kept once. Hosts the topology does not name go last in natural
    order and are also returned as the second list, so the caller can warn about them. With no
    topology every host goes in natural order and none is "missing".
    """
    unique = list(dict.fromkeys(hosts))
    if topology is None:
        return natural_sorted(unique), []
    rank = {node: i for i, node in enumerate(rank_order(topology))}
    present = sorted((h for h in unique if h in rank), key=rank.__getitem__)
    missing = natural_sorted(h for h in unique if h not in rank)
    return present + missing, missing
