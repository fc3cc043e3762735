"""Node ranks: topology order when the master has a topology, else Slurm's node order."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dlrover_hpc import topology as topo
from dlrover_hpc.rendezvous.segments import Candidate, segment_capacity

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankInput:
    agent_id: str
    node: str
    slurm_node_id: int | None = None
    topology_addr: str | None = None


def rank_nodes(nodes: Sequence[RankInput], topology: topo.Topology | None) -> list[RankInput]:
    """Order ``nodes`` for node ranks 0..n-1.

    1. a topology file: nodes under one leaf switch get adjacent ranks (missing nodes last);
    2. else every node reported ``SLURM_TOPOLOGY_ADDR``: the same rule on Slurm's own tree;
    3. else Slurm's node order (``SLURM_NODEID``), then natural name order.
    """
    by_name: dict[str, list[RankInput]] = {}
    for n in nodes:
        by_name.setdefault(n.node, []).append(n)
    names = list(by_name)
    if topology is None and names and all(n.topology_addr for n in nodes):
        topology = topo.topology_from_addrs({n.node: n.topology_addr for n in nodes})  # type: ignore[misc]
    if topology is not None:
        ordered, missing = topo.order_nodes(topology, names)
        if missing:
            log.warning("nodes missing from the topology go last nodes=%s", ",".join(missing))
    else:
        first = {n.node: n.slurm_node_id for n in nodes}
        ordered = sorted(
            names,
            key=lambda name: (
                first[name] is None,
                first[name] if first[name] is not None else 0,
                topo.natural_key(name),
            ),
        )
    # Several agents on one host (tests, bare metal): keep them together, by agent id.
    return [r for name in ordered for r in sorted(by_name[name], key=lambda r: r.agent_id)]


def block_places(
    nodes: Sequence[RankInput], topology: topo.Topology | None
) -> dict[str, tuple[str, int]]:
    """agent id -> (its node's block, its place in rank order), for segments.

    A block is a block of a block topology or a leaf switch of a tree; a node the topology
    does not name, and every node where there is no topology file, is in block "".
    """
    block_of = topology.leaf_of() if topology is not None else {}
    return {
        r.agent_id: (block_of.get(r.node, ""), i) for i, r in enumerate(rank_nodes(nodes, topology))
    }


def segment_gain(
    running: Sequence[RankInput],
    waiting: Sequence[RankInput],
    topology: topo.Topology | None,
    size: int,
) -> int:
    """How many more nodes whole segments of ``size`` hold over the running and the waiting
    nodes than run now (0: the waiting nodes complete no segment, so no scale-up)."""
    ids = {r.agent_id for r in running}
    places = block_places([*running, *waiting], topology)
    candidates = [
        Candidate(agent_id=a, block=block, order=order, was_active=a in ids)
        for a, (block, order) in places.items()
    ]
    return max(0, segment_capacity(candidates, size) - len(running))
