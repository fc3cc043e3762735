"""Node ranks: topology file first, then Slurm's topology addresses, then Slurm's node order."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dlrover_hpc import topology as topo
from dlrover_hpc.rendezvous.ranking import RankInput, rank_nodes


def names(ranked: list[RankInput]) -> list[str]:
    return [r.node for r in ranked]


def test_topology_file_puts_switch_neighbours_together(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    conf = tmp_path / "topology.conf"
    conf.write_text(
        "SwitchName=leaf0 Nodes=n[1,3]\nSwitchName=leaf1 Nodes=n[2,4]\n"
        "SwitchName=spine Switches=leaf[0-1]\n"
    )
    nodes = [RankInput(agent_id=f"a{i}", node=f"n{i}", slurm_node_id=i) for i in (4, 2, 1, 3, 9)]
    with caplog.at_level(logging.WARNING):
        ranked = rank_nodes(nodes, topo.load(str(conf)))
    order = names(ranked)
    assert order[-1] == "n9"  # not in the file: last, with a warning
    assert "nodes missing from the topology go last nodes=n9" in caplog.text
    leaf = {"n1": 0, "n3": 0, "n2": 1, "n4": 1}
    assert [leaf[n] for n in order[:4]] in ([0, 0, 1, 1], [1, 1, 0, 0])


def test_slurm_topology_addresses_when_there_is_no_file() -> None:
    nodes = [
        RankInput(agent_id="a", node="n1", slurm_node_id=0, topology_addr="spine.s0.n1"),
        RankInput(agent_id="b", node="n2", slurm_node_id=1, topology_addr="spine.s1.n2"),
        RankInput(agent_id="c", node="n3", slurm_node_id=2, topology_addr="spine.s0.n3"),
    ]
    order = names(rank_nodes(nodes, None))
    assert order.index("n2") in (0, 2)  # n1 and n3 share s0: adjacent
    assert abs(order.index("n1") - order.index("n3")) == 1


def test_slurm_node_order_then_natural_names() -> None:
    nodes = [
        RankInput(agent_id="x", node="node10"),
        RankInput(agent_id="y", node="node9"),
        RankInput(agent_id="z", node="node2", slurm_node_id=1),
        RankInput(agent_id="w", node="node1", slurm_node_id=0),
        # one address missing: Slurm's tree is not used
        RankInput(agent_id="v", node="node3", slurm_node_id=2, topology_addr="s.node3"),
    ]
    assert names(rank_nodes(nodes, None)) == ["node1", "node2", "node3", "node9", "node10"]


def test_agents_sharing_a_host_stay_together_by_agent_id() -> None:
    nodes = [
        RankInput(agent_id="h1-2", node="h1", slurm_node_id=0),
        RankInput(agent_id="h0-1", node="h0", slurm_node_id=1),
        RankInput(agent_id="h1-1", node="h1", slurm_node_id=0),
    ]
    assert [r.agent_id for r in rank_nodes(nodes, None)] == ["h1-1", "h1-2", "h0-1"]


def test_no_nodes() -> None:
    assert rank_nodes([], None) == []
