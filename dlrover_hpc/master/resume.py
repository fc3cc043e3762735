"""A master restarted from its journal adopts the round its agents are still training.

When the master's process or node dies, the agents keep their workers training and connect
again (``agent/master_link.py``).  The new master reads the journal: the round number, the
restart count, the excluded nodes, the checkpoint parts counted so far and the running round's
members.  Each member becomes a *placeholder* record: active in that round, but not heard from.
An agent that re-registers reporting it still runs that round is adopted (its workers never
stop); one that does not come back within :data:`RESUME_GRACE_S` is lost, as any silent agent
is, and the others re-form the round without it.  Once every member is settled the master
emits ``master_recovered`` with the downtime the agents saw.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from dlrover_hpc.master.nodes import NodeRecord, NodeState

log = logging.getLogger(__name__)

#: How long a restarted master waits for a member of the running round to re-register (the
#: agents retry every second at most) before it counts it lost.
RESUME_GRACE_S = 10.0


def member_row(rec: NodeRecord) -> dict[str, Any]:
    """What the journal keeps of a member of a completed round."""
    return {
        "agent_id": rec.agent_id,
        "node": rec.node,
        "addr": rec.addr,
        "nproc": rec.nproc,
        "rank": rec.rank,
        "slurm_node_id": rec.slurm_node_id,
        "topology_addr": rec.topology_addr,
        "launch_argv": list(rec.launch_argv),
        "launch_cwd": rec.launch_cwd,
    }


@dataclasses.dataclass(slots=True)
class Recovery:
    """The members a restarted master has not settled yet, and the times for the event."""

    round: int
    pending: set[str]  # node names
    journal_time: float  # wall clock of the old master's newest journal record
    started_at: float  # wall clock: this master read the journal
    lost_at: list[float] = dataclasses.field(default_factory=list)  # agents' reports
    back_at: float = 0.0  # wall clock: the newest member that came back re-registered
    settled: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {"adopted": [], "rejoined": [], "lost": []}
    )

    def report(self, master_lost_at: float) -> None:
        """An agent said when it lost the old master (wall clock; 0: it did not)."""
        if master_lost_at > 0:
            self.lost_at.append(master_lost_at)

    def settle(self, node: str, how: str, *, now: float) -> dict[str, Any] | None:
        """``node`` re-registered still training its round (``adopted``), re-registered out of
        it (``rejoined``: its workers stopped meanwhile) or never came back (``lost``); the
        ``master_recovered`` fields once none is pending."""
        if node not in self.pending:
            return None
        self.pending.discard(node)
        self.settled[how].append(node)
        if how != "lost":
            self.back_at = now
        if self.pending:
            return None
        # From the first agent's loss of the old master to the last agent's return (a member
        # that never came back is waited for no longer than the others).
        down_since = min(self.lost_at, default=self.journal_time)
        return {
            "round": self.round,
            "downtime_s": round((self.back_at or now) - down_since, 3),
            "master_down_s": round(self.started_at - down_since, 3),
            **{how: sorted(nodes) for how, nodes in self.settled.items()},
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    round: int
    restart_count: int
    excluded_nodes: frozenset[str]
    members: Sequence[NodeRecord]  # placeholders of the running round ([] when none ran)
    ckpt_parts: Sequence[Sequence[Any]]  # [path, step, ranks, world_size] of this round
    recovery: Recovery | None


def restore(saved: Mapping[str, Any], *, now: float, wall: float) -> Resumed | None:
    """The state in a loaded journal (:meth:`Journal.load`); None for a fresh job.

    ``now`` is the master's monotonic clock, ``wall`` the wall clock.  A finished job, or one
    whose journal names no members (written before this release, or no round ever completed),
    resumes with no placeholders: its agents re-join a rendezvous as they would a new master.
    """
    if "round" not in saved and "restart_count" not in saved and "excluded_nodes" not in saved:
        return None
    round_ = int(saved.get("round", 0))
    members = [] if saved.get("finished") else list(saved.get("members", []))
    records = [
        NodeRecord(
            agent_id=str(row["agent_id"]),
            node=str(row["node"]),
            addr=str(row["addr"]),
            nproc=int(row["nproc"]),
            slurm_node_id=row.get("slurm_node_id"),
            topology_addr=row.get("topology_addr"),
            state=NodeState.ACTIVE,
            rank=int(row["rank"]),
            round=round_,
            joined_at=now,
            last_seen=now,
            disconnected_at=now,  # not waited for by a rendezvous until it re-registers
            launch_argv=tuple(row.get("launch_argv", ())),
            launch_cwd=str(row.get("launch_cwd", "")),
            resumed=True,
        )
        for row in members
    ]
    recovery = (
        Recovery(
            round=round_,
            pending={r.node for r in records},
            journal_time=float(saved.get("time", wall)),
            started_at=wall,
        )
        if records
        else None
    )
    log.info(
        "master resumed from journal round=%d restarts=%d members=%s",
        round_,
        int(saved.get("restart_count", 0)),
        ",".join(r.node for r in records) or "-",
    )
    return Resumed(
        round=round_,
        restart_count=int(saved.get("restart_count", 0)),
        excluded_nodes=frozenset(saved.get("excluded_nodes", [])),
        members=records,
        ckpt_parts=list(saved.get("ckpt_parts", [])) if records else [],
        recovery=recovery,
    )
