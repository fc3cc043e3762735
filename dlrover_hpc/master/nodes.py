"""The master's node table entries and the small interfaces the job state depends on."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Protocol

from dlrover_hpc.checkpoint.saver.replicas import replica_candidates
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.messages import NodeState
from dlrover_hpc.rendezvous.ranking import RankInput

__all__ = [
    "Clock",
    "NodeRecord",
    "NodeState",
    "StoreFactory",
    "node_rows",
    "round_assignments",
    "summary_rows",
]


@dataclasses.dataclass(slots=True, kw_only=True)
class NodeRecord:
    agent_id: str
    node: str
    addr: str
    nproc: int
    slurm_node_id: int | None
    topology_addr: str | None
    state: NodeState = NodeState.WAITING
    rank: int = -1
    round: int = 0
    joined_at: float = 0.0
    last_seen: float = 0.0
    disconnected_at: float | None = None
    link_timed_out: bool = False  # the disconnect was TCP giving up on a silent link
    #: lost, and Slurm took its node out of the job meanwhile: its agent is told to exit
    left_job: bool = False
    waiter: asyncio.Future[m.Assignment] | None = None
    assignment: m.Assignment | None = None  # of the newest round it was in
    pending: m.Assignment | None = None  # a task for its next WaitRound (network check)
    launch_argv: tuple[str, ...] = ()  # how to start this node's agent again (Join)
    launch_cwd: str = ""
    replica_port: int = 0  # its checkpoint replica server (Join), 0: none
    stopped: bool = False  # its workers ended for a stop notice (WorkersSucceeded)
    checkpoints: list[m.Durability] = dataclasses.field(default_factory=list)  # at its end
    #: a member of the running round restored from the journal, not yet heard from
    resumed: bool = False
    reason: str = ""  # why it is out of the job (an unhealthy node's check), for status
    #: benched because Slurm drained its node (:mod:`dlrover_hpc.master.node_states`): never
    #: taken back while drained, a hot spare again once the drain is lifted
    drained: bool = False
    #: a benched straggler that a round short of MIN took back: it trains until a waiting node
    #: can take its place (``Job._grow``), unless it keeps its peers' pace by then
    taken_back: bool = False


class StoreFactory(Protocol):
    """Makes a fresh key-value store for a round's workers; returns its port."""

    def new_store(self, round: int) -> int: ...

    def ready(self) -> bool:
        """new_store would not block (the factory's own set-up is done)."""
        ...


class Clock(Protocol):
    def __call__(self) -> float: ...


def rank_input(n: NodeRecord) -> RankInput:
    return RankInput(
        agent_id=n.agent_id,
        node=n.node,
        slurm_node_id=n.slurm_node_id,
        topology_addr=n.topology_addr,
    )


def round_assignments(
    ranked: Sequence[NodeRecord],
    *,
    round: int,
    store_host: str,
    store_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
) -> list[m.Assignment]:
    """Each ranked node's part of a new round: node rank, world size, its first global rank,
    and where every node's checkpoint replicas go."""
    world = sum(n.nproc for n in ranked)
    peers = [f"{n.addr}:{n.replica_port}" if n.replica_port else "" for n in ranked]
    replicas = any(peers)  # else every map is empty: no pass over each rank's candidates
    nnodes = len(ranked)
    out: list[m.Assignment] = []
    offset = 0
    for rank, rec in enumerate(ranked):
        out.append(
            m.Assignment(
                status=m.NodeStatus.ACTIVE,
                round=round,
                node_rank=rank,
                nnodes=nnodes,
                world_size=world,
                rank_offset=offset,
                store_host=store_host,
                store_port=store_port,
                restart_count=restart_count,
                max_restarts=max_restarts,
                run_id=run_id,
                replica_peer_map={
                    str(i): peers[i] for i in replica_candidates(rank, nnodes) if peers[i]
                }
                if replicas
                else {},
            )
        )
        offset += rec.nproc
    return out


def node_rows(records: Iterable[NodeRecord]) -> list[m.NodeRow]:
    """The status table: ranked nodes in rank order, then the others by name."""
    ordered = sorted(records, key=lambda n: (n.rank < 0, n.rank, n.node))
    return [
        m.NodeRow(
            agent_id=n.agent_id,
            node=n.node,
            rank=n.rank,
            state=n.state,
            round=n.round,
            nproc=n.nproc,
            reason=n.reason,
        )
        for n in ordered
    ]


#: a status summary shows this many of the slowest running nodes, and of the others
SLOWEST_SHOWN, OTHERS_SHOWN = 5, 20


def summary_rows(rows: list[m.NodeRow], stragglers: set[str]) -> list[m.NodeRow]:
    """The rows a summary keeps, in the table's order: the slowest running nodes (lowest
    step), the stragglers', and the first nodes that are not running (lost, excluded,
    waiting)."""
    running = [r for r in rows if r.state in (NodeState.ACTIVE, NodeState.DONE)]
    slowest = sorted(running, key=lambda r: (r.step, r.rank))[:SLOWEST_SHOWN]
    others = [r for r in rows if r.state not in (NodeState.ACTIVE, NodeState.DONE)]
    keep = {id(r) for r in slowest + others[:OTHERS_SHOWN]}
    keep |= {id(r) for r in rows if r.node in stragglers}
    return [r for r in rows if id(r) in keep]
