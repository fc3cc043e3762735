"""When to start a new agent on a node the job still holds: pure, like :mod:`decisions`.

An agent that dies (SIGKILL, OOM killer, a crash of ``dlrover-run`` itself) on a node that Slurm
still gives the job leaves that node idle for the rest of the job unless something starts a
new agent there.  Slurm does not: the agents' step runs with ``--no-kill``.  The master does,
with ``srun --jobid --overlap -N1 -n1 -w NODE`` and the lost agent's own command line
(:mod:`dlrover_hpc.master.relaunch`); the new agent joins as a spare and is admitted at the
next rendezvous.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from dlrover_hpc.master.decisions import HOSTING, RETRY_FIRST_S, Relaunch
from dlrover_hpc.master.nodes import NodeRecord, NodeState

#: A relaunched agent that has not joined this long after its srun started has failed.
RELAUNCH_JOIN_S = 60.0
#: Relaunches of one node in a row that never joined, before it is left to replacements.
MAX_RELAUNCHES = 3
#: Slurm node states (``sinfo %t``) in which a new job step cannot start on the node.
#: Longest a loss holds replacement requests back while the allocation is looked at.
JUDGE_MAX_S = 10.0
UNUSABLE_STATES = ("down", "drain", "drng", "fail", "maint", "boot", "powered", "pow", "futr")


@dataclasses.dataclass(frozen=True, slots=True)
class Relaunching:
    """A node's relaunches: how many in a row did not join, and when the newest started."""

    failed: int = 0
    started_at: float | None = None  # None: none in flight
    ended_at: float = float("-inf")  # when the newest ended without joining

    def in_flight(self, now: float) -> bool:
        return self.started_at is not None and now - self.started_at < RELAUNCH_JOIN_S


def slurm_usable(state: str) -> bool:
    """A compact ``sinfo`` state of a responding node where a step can start (``*``: the node
    does not respond; ``~``/``#``: powered down or up)."""
    return not state.endswith(("*", "~", "#", "!", "%")) and not state.startswith(UNUSABLE_STATES)


def relaunches(
    records: Sequence[NodeRecord],
    *,
    excluded_nodes: Iterable[str],
    allocation: dict[str, str],
    attempts: dict[str, Relaunching],
    now: float,
) -> list[Relaunch]:
    """Nodes to start a new agent on: a lost agent's node that Slurm still gives the job and
    reports healthy (``allocation``: node -> ``sinfo`` state), with no agent there now, not
    faulty; not after a link timeout (the agent may be alive and reconnect:
    ``node_readmitted``).  At MAX too: the node is the job's either way, and a new agent there
    waits as a hot spare for the next loss.  A node whose relaunches failed ``MAX_RELAUNCHES``
    times in a row is left to replacement jobs; retries back off 5, 10, 20 s."""
    usable = {n.node for n in records if n.state in HOSTING}
    flying = {node for node, r in attempts.items() if r.in_flight(now)} - usable
    excluded = set(excluded_nodes)
    out: list[Relaunch] = []
    # A link that timed out may come back with its agent alive: that agent reconnects.
    lost = {
        n.node: n
        for n in records
        if n.state is NodeState.LOST and n.launch_argv and not n.link_timed_out
    }
    for node, rec in sorted(lost.items()):
        if node in usable or node in excluded or node in flying:
            continue
        if not slurm_usable(allocation.get(node, "down")):
            continue
        r = attempts.get(node, Relaunching())
        backoff = RETRY_FIRST_S * 2 ** (r.failed - 1) if r.failed else 0.0
        if r.failed >= MAX_RELAUNCHES or now - r.ended_at < backoff:
            continue
        out.append(Relaunch(node, rec.agent_id, r.failed + 1))
    return out


@dataclasses.dataclass(slots=True)
class RelaunchBook:
    """The master's relaunch state: attempts per node, and when it last looked at the job's
    allocation (``squeue`` and ``sinfo``)."""

    attempts: dict[str, Relaunching] = dataclasses.field(default_factory=dict)
    allocation_at: float = float("-inf")
    allocation: dict[str, str] | None = None  # the newest look: node -> sinfo state
    last_loss_at: float = float("-inf")  # when the newest node was lost

    def judging(self, now: float) -> bool:
        """A loss newer than the allocation's snapshot: it may yet be relaunched (for at most
        ``JUDGE_MAX_S``, so a Slurm that does not answer never holds replacements back)."""
        return self.last_loss_at >= self.allocation_at and now - self.last_loss_at < JUDGE_MAX_S

    def in_flight(self, now: float) -> int:
        return sum(1 for r in self.attempts.values() if r.in_flight(now))

    def started(self, node: str, now: float) -> None:
        self.attempts[node] = dataclasses.replace(
            self.attempts.get(node, Relaunching()), started_at=now
        )

    def joined(self, node: str) -> None:
        """An agent joined from ``node``: a relaunch there succeeded."""
        if node in self.attempts:
            self.attempts[node] = Relaunching()

    def ended(self, node: str, now: float) -> bool:
        """The srun of a relaunch on ``node`` exited; True when its agent never joined."""
        r = self.attempts.get(node)
        if r is None or r.started_at is None:
            return False
        self.attempts[node] = Relaunching(failed=r.failed + 1, ended_at=now)
        return True
