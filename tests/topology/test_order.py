"""Rank ordering: examples, natural sort, and properties over random trees (hypothesis)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrover_hpc.topology import (
    Switch,
    Topology,
    loads,
    natural_sorted,
    order_nodes,
    rank_order,
    render_slurm_conf,
    switch_levels,
)

pytestmark = pytest.mark.timeout(120)


def test_natural_order() -> None:
    names = ["node10", "node2", "node1", "gpu-a010", "gpu-a002", "10.0.0.10", "10.0.0.9", "n01"]
    assert natural_sorted(names) == [
        "10.0.0.9",
        "10.0.0.10",
        "gpu-a002",
        "gpu-a010",
        "n01",
        "node1",
        "node2",
        "node10",
    ]
    assert natural_sorted(["n1", "n01", "n001"]) == ["n001", "n01", "n1"]  # ties: by name


def test_fat_tree_order_groups_leaves() -> None:
    topology = loads(
        "SwitchName=leafB Nodes=node[10,2,7]\n"
        "SwitchName=leafA Nodes=node[1,11]\n"
        "SwitchName=leafC Nodes=node3\n"
        "SwitchName=spine1 Switches=leafB\n"
        "SwitchName=spine0 Switches=leafC,leafA\n",
        source="t.conf",
    )
    hosts = [f"node{i}" for i in (1, 2, 3, 7, 10, 11)]
    ordered, missing = order_nodes(topology, hosts)
    # spine0 (leafA, leafC) then spine1 (leafB); natural order inside each leaf.
    assert ordered == ["node1", "node11", "node3", "node2", "node7", "node10"]
    assert missing == []


def test_missing_nodes_go_last_in_natural_order() -> None:
    topology = loads("SwitchName=l0 Nodes=n[3-4]\n", source="t.conf")
    ordered, missing = order_nodes(topology, ["x10", "n4", "x9", "n3", "n4"])
    assert ordered == ["n3", "n4", "x9", "x10"]
    assert missing == ["x9", "x10"]


def test_no_topology_is_natural_order() -> None:
    assert order_nodes(None, ["node10", "node2", "node2", "node1"]) == (
        ["node1", "node2", "node10"],
        [],
    )


def test_dlrover_style_access_switches() -> None:
    # Ten nodes spread over three access switches round-robin, as in DLRover's sorter test.
    text = "".join(f"asw-{i % 3} psw-0 10.0.0.{i}\n" for i in range(10))
    ordered, _ = order_nodes(loads(text), [f"10.0.0.{i}" for i in range(10)])
    assert [int(h.rsplit(".", 1)[1]) for h in ordered] == [0, 3, 6, 9, 1, 4, 7, 2, 5, 8]


def test_second_parent_is_ignored_for_order() -> None:
    topology = loads(
        "SwitchName=l0 Nodes=a\nSwitchName=l1 Nodes=b\nSwitchName=l2 Nodes=c\n"
        "SwitchName=s1 Switches=l[0,2]\nSwitchName=s0 Switches=l1,l2\n",
        source="t.conf",
    )
    # l2's first parent in file order is s1, so it sits with l0.
    assert rank_order(topology) == ["b", "a", "c"]


def test_rank_order_is_total_on_a_cycle() -> None:
    topology = Topology(
        switches=(
            Switch(name="a", switches=("b",)),
            Switch(name="b", switches=("a", "l")),
            Switch(name="l", nodes=("n2", "n1")),
        )
    )
    assert rank_order(topology) == ["n1", "n2"]


NAME_STYLES = [
    lambda i: f"node{i}",
    lambda i: f"gpu-a{i:03d}",
    lambda i: f"10.0.{i // 250}.{i % 250}",
    lambda i: f"r{i % 7}n{i}",
]


@st.composite
def trees(draw: st.DrawFn) -> tuple[Topology, list[str]]:
    style = draw(st.sampled_from(NAME_STYLES))
    n_spines = draw(st.integers(min_value=1, max_value=4))
    counter = draw(st.integers(min_value=0, max_value=50))
    switches: list[Switch] = []
    nodes: list[str] = []
    leaf_id = 0
    for s in range(n_spines):
        n_leaves = draw(st.integers(min_value=1, max_value=4))
        kids = []
        for _ in range(n_leaves):
            size = draw(st.integers(min_value=1, max_value=5))
            leaf_nodes = [style(counter + k) for k in range(size)]
            counter += size + draw(st.integers(min_value=0, max_value=3))
            nodes.extend(leaf_nodes)
            switches.append(Switch(name=f"leaf{leaf_id}", nodes=tuple(leaf_nodes)))
            kids.append(f"leaf{leaf_id}")
            leaf_id += 1
        switches.append(Switch(name=f"spine{s}", switches=tuple(kids)))
    if draw(st.booleans()):
        switches.append(Switch(name="core", switches=tuple(f"spine{s}" for s in range(n_spines))))
    order = draw(st.permutations(switches))
    return Topology(switches=tuple(order)), nodes


@st.composite
def cases(draw: st.DrawFn) -> tuple[Topology, list[str], list[str]]:
    topology, nodes = draw(trees())
    chosen = draw(st.lists(st.sampled_from(nodes), max_size=len(nodes) + 3))
    extra = draw(st.lists(st.sampled_from(["zz1", "zz10", "zz2", "aa", "node-x"]), max_size=3))
    hosts = draw(st.permutations(chosen + extra))
    return topology, nodes, list(hosts)


def _subtrees(topology: Topology) -> dict[str, set[str]]:
    by_name = topology.by_name()
    out: dict[str, set[str]] = {}

    def below(name: str) -> set[str]:
        if name not in out:
            sw = by_name[name]
            nodes = set(sw.nodes)
            for child in sw.switches:
                nodes |= below(child)
            out[name] = nodes
        return out[name]

    for name in by_name:
        below(name)
    return out


@settings(max_examples=150, deadline=None)
@given(cases())
def test_order_properties(case: tuple[Topology, list[str], list[str]]) -> None:
    topology, nodes, hosts = case
    ordered, missing = order_nodes(topology, hosts)
    unique = set(hosts)
    # A permutation of the distinct hosts.
    assert sorted(ordered) == sorted(unique)
    assert len(ordered) == len(unique)
    # Missing hosts: exactly those not in the file, last, in natural order.
    assert missing == natural_sorted(unique - set(nodes))
    assert ordered[len(ordered) - len(missing) :] == missing
    # Every switch's subtree is one contiguous run (leaves and spines alike).
    position = {h: i for i, h in enumerate(ordered)}
    for members in _subtrees(topology).values():
        places = sorted(position[h] for h in members if h in position)
        if places:
            assert places[-1] - places[0] + 1 == len(places)
    # Natural order within a leaf.
    for sw in topology.switches:
        inside = [h for h in ordered if h in set(sw.nodes)]
        assert inside == natural_sorted(inside)
    # Deterministic: same answer for any input order and any switch line order.
    shuffled = list(hosts)
    random.Random(len(hosts)).shuffle(shuffled)
    relined = topology.with_switches(reversed(topology.switches))
    assert order_nodes(relined, shuffled) == (ordered, missing)
    # Writing and reading a topology.conf keeps the order.
    reread = loads(render_slurm_conf(topology), source="r.conf")
    assert order_nodes(reread, hosts) == (ordered, missing)


def test_levels_and_a_diamond_is_not_a_cycle() -> None:
    text = (
        "SwitchName=l0 Nodes=a\nSwitchName=l1 Nodes=b\n"
        "SwitchName=s0 Switches=l[0-1]\nSwitchName=s1 Switches=l1\n"
        "SwitchName=core Switches=s[0-1]\n"
    )
    topology = loads(text, source="t.conf")  # l1 under s0 and s1: valid, no cycle
    assert switch_levels(topology) == {"l0": 0, "l1": 0, "s0": 1, "s1": 1, "core": 2}
    assert rank_order(topology) == ["a", "b"]
