"""The master's node table entries and the small interfaces the job state depends on."""

from __future__ import annotations

import asyncio
import dataclasses
from enum import Enum
from typing import Protocol

from dlrover_hpc.protocol import messages as m
from dlrover_hpc.rendezvous.ranking import RankInput


class NodeState(Enum):
    WAITING = "waiting"  # in rendezvous (a hot spare waits here too)
    ACTIVE = "active"  # in the current round, workers running
    DONE = "done"  # workers finished successfully
    LOST = "lost"  # stopped heart-beating or disconnected
    EXCLUDED = "excluded"  # quarantined / drained: never admitted again in this job


class JobState(Enum):
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    FINISHED = "finished"


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
    waiter: asyncio.Future[m.Assignment] | None = None
    assignment: m.Assignment | None = None  # of the newest round it was in
    pending: m.Assignment | None = None  # a task for its next WaitRound (network check)


class StoreFactory(Protocol):
    """Makes a fresh key-value store for a round's workers; returns its port."""

    def new_store(self, round: int) -> int: ...


class Clock(Protocol):
    def __call__(self) -> float: ...


def rank_input(n: NodeRecord) -> RankInput:
    return RankInput(
        agent_id=n.agent_id,
        node=n.node,
        slurm_node_id=n.slurm_node_id,
        topology_addr=n.topology_addr,
    )
