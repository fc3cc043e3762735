"""Live node states: what Slurm says about the job's nodes while they train (issue 48).

An admin, or the site's node health checker (NHC, Slurm's HealthCheckProgram), drains a node
with ``scontrol update NodeName=X State=DRAIN Reason=...``; Slurm lets the job run on there.
The master looks every :data:`POLL_EVERY_S` at the Slurm state of each node its agents run on,
with ONE ``scontrol -o show node HOSTLIST`` for the whole job (in a thread, with a timeout: a
slow or failing scontrol only delays the next look, never the master's loop), and:

- DRAIN (``MIXED+DRAIN``, ``ALLOCATED+DRAIN``, ``IDLE+DRAIN``) or FAIL on a node that trains:
  ``node_state_changed``, then the node is swapped out at the next step every rank holds in
  memory (as a runtime straggler is, :mod:`dlrover_hpc.master.hangs`), so the restart loses no
  step; at the latest after :data:`SWAP_WAIT_MAX_S`, at once when the job saves no
  checkpoint. Not while it would leave fewer than MIN nodes (``decisions.can_leave``): the
  job would stop, waiting for nodes; the node trains on until a spare or a replacement is
  there. Its agent waits on the node, benched (``drained``: no round takes it back while it
  is drained), a spare or a replacement taking its place as for a lost node; it is not
  drained again (the reason is Slurm's). On a node that waits (a hot spare, a benched
  node): benched at once.
- The drain lifted (``scontrol update ... state=resume``; NHC resumes the nodes it drained
  once their check passes): the node's agent is a hot spare again, and a round below MAX takes
  it in at the next checkpoint; a drained node that still trains (held for MIN, or waiting for
  its step in memory) trains on.  A node drained a second time in the job is excluded for
  good: a node that flaps costs a restart each time.
- DOWN, or NOT_RESPONDING on two looks in a row: the node's agents are lost at once
  (``node_lost``).
- A node lost that comes back (up in Slurm, an agent of the job on it again: a node back
  from a crash that a replacement or a relaunch took) is watched afresh: its next drain is
  acted on as any other's.
- A node the master took out itself (excluded; its own drain's reason names the job) is not
  acted on again.

The decisions (:func:`verdict`, :func:`changes`, :func:`respond`) are pure; :class:`NodeStateWatch`
polls and carries their actions out through :meth:`Job.apply`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from dlrover_hpc.errors import SlurmError
from dlrover_hpc.events import EventName
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.nodes import NodeRecord, NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.slurm.parse import SlurmNode

log = logging.getLogger(__name__)

#: How often the master asks Slurm for the states of the job's nodes (one call for them all).
POLL_EVERY_S = 5.0
#: The longest one look may take (scontrol's own message timeout is 5-10 s).
POLL_TIMEOUT_S = 10.0
#: After failed looks, the next waits twice as long each time, up to this.
POLL_BACKOFF_MAX_S = 60.0
#: The longest a drained node's swap waits for a step every rank holds in memory.
SWAP_WAIT_MAX_S = 30.0
#: How often a pending swap looks at the ranks' saved steps (heartbeats bring them).
SWAP_CHECK_S = 0.5

#: Agents in these states are on their node for this job: their node is watched.
WATCHED = frozenset({NodeState.ACTIVE, NodeState.WAITING, NodeState.BENCHED})

#: Reads the Slurm state of the given nodes in one call (a thread runs it).
ReadStates = Callable[[Sequence[str]], Mapping[str, SlurmNode]]


@dataclasses.dataclass(frozen=True, slots=True)
class Park:
    """Take ``node`` out of the rounds while Slurm keeps it drained: its agents wait there,
    hot spares again once the drain is lifted (:func:`lifted`)."""

    node: str
    reason: str


class Verdict(enum.Enum):
    SWAP = "swap"  # DRAIN or FAIL: out at the next step every rank holds in memory
    LOST = "lost"  # DOWN or NOT_RESPONDING: lost at once


def verdict(node: SlurmNode) -> Verdict | None:
    """What a node's Slurm state means for the job; None: nothing (IDLE, MIXED, ALLOCATED,
    COMPLETING, a planned reboot...)."""
    if node.state == "DOWN" or "NOT_RESPONDING" in node.flags:
        return Verdict.LOST
    if node.state == "FAIL" or {"DRAIN", "FAIL"} & node.flags:
        return Verdict.SWAP
    return None


def slurm_state(node: SlurmNode) -> str:
    """``MIXED+DRAIN`` as scontrol prints it (flags sorted)."""
    return "+".join([node.state, *sorted(node.flags)])


def own_drain(reason: str, job_id: str) -> bool:
    """The reason is the one this job's master gives its own drains (``dlrover-hpc: ... job
    J``, :class:`dlrover_hpc.master.policy.NodeRemover`), with Slurm's ``[user@time]``."""
    text = reason.rsplit(" [", 1)[0] if reason.endswith("]") else reason  # Slurm's stamp
    return text.startswith("dlrover-hpc:") and text.endswith(f" job {job_id}")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Changed:
    """A watched node's Slurm state that the job acts on."""

    node: str
    slurm_state: str
    reason: str
    verdict: Verdict


def watched_nodes(records: Sequence[NodeRecord], excluded: Collection[str]) -> list[str]:
    """The nodes to ask Slurm about: those of agents in :data:`WATCHED` states, not excluded."""
    return sorted({n.node for n in records if n.state in WATCHED and n.node not in excluded})


def unresponsive(states: Mapping[str, SlurmNode]) -> frozenset[str]:
    """The nodes Slurm marks NOT_RESPONDING but not (yet) DOWN."""
    return frozenset(
        n for n, s in states.items() if "NOT_RESPONDING" in s.flags and s.state != "DOWN"
    )


def changes(
    states: Mapping[str, SlurmNode],
    *,
    nodes: Sequence[str],
    said: Mapping[str, Verdict],
    job_id: str,
    unresponsive_before: Collection[str] = frozenset(),
) -> list[Changed]:
    """The ``nodes`` whose state asks for an action not taken yet: a new verdict, or a
    drained node gone down since (``said``: the verdict acted on per node).  NOT_RESPONDING
    without DOWN counts only when the previous look saw it too (``unresponsive_before``):
    Slurm sets it for a moment on a node it has just resumed, even one that runs a job
    (captured here).  Linear in the nodes; a node Slurm did not print is left for the next
    look."""
    out = []
    for node in nodes:
        found = states.get(node)
        if found is None:
            continue
        v = verdict(found)
        before = said.get(node)
        if v is None or before is v or before is Verdict.LOST or own_drain(found.reason, job_id):
            continue
        if found.state != "DOWN" and v is Verdict.LOST and node not in unresponsive_before:
            continue  # a missed ping, or just resumed: DOWN follows if it lasts
        out.append(
            Changed(node=node, slurm_state=slurm_state(found), reason=found.reason, verdict=v)
        )
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SwapAtSave:
    """Take ``node`` out at the next step every rank holds in memory (it trains now)."""

    node: str
    reason: str


def lifted(
    states: Mapping[str, SlurmNode], *, said: Mapping[str, Verdict], job_id: str
) -> list[str]:
    """The nodes acted on as drained (or failed) whose state Slurm no longer marks so: their
    drain was lifted (a node Slurm did not print is left for the next look)."""
    out = []
    for node, before in said.items():
        found = states.get(node)
        if before is not Verdict.SWAP or found is None:
            continue
        if verdict(found) is None and not own_drain(found.reason, job_id):
            out.append(node)
    return sorted(out)


def recovered(states: Mapping[str, SlurmNode], *, said: Mapping[str, Verdict]) -> list[str]:
    """The nodes acted on as lost (DOWN) that Slurm marks up again, with an agent of this job
    on them once more (a node back from a crash, taken by a replacement or a relaunch): a
    later drain or loss of theirs is news (a node Slurm did not print is left as it was)."""
    return sorted(
        node
        for node, before in said.items()
        if before is Verdict.LOST and node in states and verdict(states[node]) is None
    )


def leaving(node: str, reason: str, *, again: bool) -> Park | d.Exclude:
    """How a drained node leaves the rounds: benched while drained; excluded for good when it
    was drained before in this job and came back (``again``: a node that flaps)."""
    return d.Exclude(node, reason) if again else Park(node, reason)


def said_action(v: Verdict, *, swap: bool, again: bool) -> str:
    """The ``action`` of a ``node_state_changed`` for a verdict acted on."""
    if v is Verdict.LOST:
        return "lost at once"
    how = "swapped out" if swap else "excluded"
    if again:
        return f"{how} for good: drained a second time in this job"
    if swap:
        return "swapped out at the next step every rank holds in memory"
    return "benched while drained"


def respond(
    change: Changed,
    records: Sequence[NodeRecord],
    *,
    phase: Phase,
    round: int,
    again: bool = False,
) -> list[d.Action | SwapAtSave | Park]:
    """The actions for one change.  Lost: each of the node's watched agents.  Drained or
    failed: benched at once (:class:`Park`) unless one of its agents trains in the running
    round; excluded for good when it was drained before in this job and came back
    (``again``)."""
    on_node = [n for n in records if n.node == change.node and n.state in WATCHED]
    why = f"Slurm set it {change.slurm_state}" + (f": {change.reason}" if change.reason else "")
    if change.verdict is Verdict.LOST:
        return [d.MarkLost(n.agent_id, why) for n in on_node]
    training = any(n.state is NodeState.ACTIVE and n.round == round for n in on_node)
    if training and phase is Phase.RUNNING:
        return [SwapAtSave(change.node, why)]
    return [leaving(change.node, why, again=again)] if on_node else []


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    """A drained node's swap, waiting for a step in memory (``held``: and for a node to take
    its place, as the job would have fewer than MIN without it)."""

    reason: str
    wait: d.ScaleUpWait
    held: bool = False


def swap_due(
    pending: Pending, *, steps: tuple[int, int] | None, committed: int, now: float
) -> str | None:
    """Why the swap goes now, or None to keep waiting.  ``steps``: (the oldest of the ranks'
    newest steps in memory, the newest step reported; None: not every rank reported);
    ``committed``: the newest step committed to storage.  A job that saved nothing (no step in
    memory, none committed) has nothing to wait for."""
    if steps is not None and steps[0] < 0 and committed < 0:
        return "the job holds no checkpoint to wait for"
    return d.scale_up_due(
        pending.wait,
        saved=steps[0] if steps is not None else None,
        committed=committed,
        now=now,
        limit_s=SWAP_WAIT_MAX_S,
    )


Push = Callable[[str, m.Message], None]


class NodeStateWatch:
    """Polls Slurm for the job's nodes (:func:`read`: one call, in a thread) and carries out
    the decisions above.  :meth:`round_opening` runs as a round re-opens for another reason."""

    def __init__(self, job: Job, push: Push, read: ReadStates) -> None:
        self.job, self._push, self._read = job, push, read
        self.said: dict[str, Verdict] = {}
        self.pending: dict[str, Pending] = {}
        self.returned: set[str] = set()  # drained, then resumed: a second drain excludes
        self.failures = 0
        self.poll_s: list[float] = []  # the newest 16 looks' seconds (what a look costs)
        self._next_poll = 0.0
        self._unresponsive: frozenset[str] = frozenset()  # NOT_RESPONDING at the last look
        self._polling = False

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        """Look at Slurm every :data:`POLL_EVERY_S` (off the event loop); check pending swaps
        every :data:`SWAP_CHECK_S`."""
        tasks: set[asyncio.Task[None]] = set()
        while not self.job.ended:
            await asyncio.sleep(SWAP_CHECK_S)
            self.check_swaps()
            if self._polling or self.job.clock() < self._next_poll:
                continue
            nodes = watched_nodes(list(self.job.nodes.values()), self.job.excluded_nodes)
            if not nodes:
                continue
            self._polling = True
            task = asyncio.get_running_loop().create_task(self._poll(nodes))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _poll(self, nodes: list[str]) -> None:
        """One look (a task of its own: the command's thread never holds up the loop)."""
        began = time.perf_counter()
        try:
            states = await asyncio.to_thread(self._read, nodes)
        except SlurmError as exc:
            self._failed(str(exc))
            return
        except Exception as exc:  # the task's boundary: the watch goes on, said once
            log.exception("reading the job's node states failed")
            self._failed(repr(exc))
            return
        finally:
            self._polling = False
        self.poll_s = [*self.poll_s[-15:], time.perf_counter() - began]
        self.failures = 0
        self._next_poll = self.job.clock() + POLL_EVERY_S
        try:
            self.seen(states, nodes)
        except Exception:  # a bug in a decision must not end the watch (nor the loop)
            log.exception("acting on the job's node states failed")

    def _failed(self, error: str) -> None:
        """A look failed: the next one waits twice as long each time (at most 60 s)."""
        self.failures += 1
        wait = min(POLL_BACKOFF_MAX_S, POLL_EVERY_S * 2**self.failures)
        self._next_poll = self.job.clock() + wait
        say = log.warning if self.failures == 1 else log.debug
        say("cannot read the job's node states (next look in %.0f s): %s", wait, error)

    def seen(self, states: Mapping[str, SlurmNode], nodes: Sequence[str]) -> None:
        """Act on one look at the nodes' states."""
        job = self.job
        if job.ended:
            return
        for node in recovered(states, said=self.said):
            del self.said[node]  # watched again: its agents are back (only those are asked)
            log.info("node back up node=%s: its Slurm state is watched again", node)
        before, self._unresponsive = self._unresponsive, unresponsive(states)
        found = changes(
            states,
            nodes=nodes,
            said=self.said,
            job_id=job.config.job_id,
            unresponsive_before=before,
        )
        for change in found:
            records = list(job.nodes.values())
            again = change.node in self.returned
            actions = respond(change, records, phase=job.phase, round=job.round, again=again)
            if not actions:
                continue  # its agents left meanwhile (lost, done): nothing to act on
            self.said[change.node] = change.verdict
            swap = [a for a in actions if isinstance(a, SwapAtSave)]
            if change.verdict is Verdict.LOST:
                self.pending.pop(change.node, None)
            how = said_action(change.verdict, swap=bool(swap), again=again)
            log.warning(
                "node state changed node=%s slurm_state=%s reason=%r: %s",
                change.node,
                change.slurm_state,
                change.reason,
                how,
            )
            job.emit(
                EventName.NODE_STATE_CHANGED,
                node=change.node,
                slurm_state=change.slurm_state,
                reason=change.reason,
                action=how,
            )
            for a in swap:
                steps = job.saved_steps() if job.saved_steps is not None else None
                after = steps[1] if steps is not None else -1
                wait = d.ScaleUpWait(since=job.clock(), after_step=after)
                self.pending[a.node] = Pending(reason=a.reason, wait=wait)
            self._apply([a for a in actions if not isinstance(a, SwapAtSave)])
        for node in lifted(states, said=self.said, job_id=job.config.job_id):
            self._lifted(node, states[node])
        self.check_swaps()

    def _lifted(self, node: str, found: SlurmNode) -> None:
        """The node's drain was lifted: a swap that waits is dropped (it trains on), a benched
        agent is a hot spare again."""
        job = self.job
        del self.said[node]
        self.returned.add(node)
        if self.pending.pop(node, None) is not None:
            how = "trains on: its drain was lifted"
        elif job.unbench(node):
            how = "back as a hot spare: its drain was lifted"
        else:
            return  # its agents left meanwhile (lost, excluded): nothing to take back
        log.warning("node state changed node=%s slurm_state=%s: %s", node, slurm_state(found), how)
        job.emit(
            EventName.NODE_STATE_CHANGED,
            node=node,
            slurm_state=slurm_state(found),
            reason=found.reason,
            action=how,
        )

    def check_swaps(self) -> None:
        """Swap out the drained nodes whose next step in memory came (or whose wait ran out)."""
        job = self.job
        if not self.pending or job.phase is not Phase.RUNNING:
            return
        steps = job.saved_steps() if job.saved_steps is not None else None
        now = job.clock()
        for node, pending in list(self.pending.items()):
            if self._held(node, pending):
                continue
            why = swap_due(pending, steps=steps, committed=job.last_committed, now=now)
            if why is None or node not in self.pending:
                continue
            del self.pending[node]
            log.warning("swapping out the drained node node=%s: %s", node, why)
            self._leave(node, pending.reason)

    def round_opening(self) -> None:
        """A round re-opens for another reason while swaps wait: the restart is there anyway,
        so the drained nodes are left out of it now."""
        for node, pending in list(self.pending.items()):
            if self._held(node, pending):
                continue  # it trains in the next round too
            del self.pending[node]
            log.warning("drained node left out of the next round node=%s", node)
            self._leave(node, pending.reason)

    def _held(self, node: str, pending: Pending) -> bool:
        """Whether the drained node trains on, the job having fewer than MIN without it: its
        swap then waits, from now, for a node to take its place and then for the next step
        in memory (not cut short by a bound that ran out while it waited)."""
        job = self.job
        if d.can_leave(node, list(job.nodes.values()), min_nodes=job.params.min_nodes):
            return False
        if not pending.held:
            log.warning(
                "drained node trains on node=%s: without it fewer than MIN %d nodes are left; "
                "swapped out once a spare or a replacement is there",
                node,
                job.params.min_nodes,
            )
        steps = job.saved_steps() if job.saved_steps is not None else None
        wait = d.ScaleUpWait(since=job.clock(), after_step=steps[1] if steps is not None else -1)
        self.pending[node] = dataclasses.replace(pending, wait=wait, held=True)
        return True

    # ------------------------------------------------------------------ executor
    def _leave(self, node: str, reason: str) -> None:
        """A drained node that trained goes: benched while drained, or excluded for good when
        it was drained before in this job."""
        self._apply([leaving(node, reason, again=node in self.returned)])

    def _exclude(self, node: str, reason: str) -> None:
        """Tell the node's training agents their round is over, then exclude it (the round
        re-forms without it; a spare or a replacement takes its place)."""
        job = self.job
        for rec in job.nodes.values():
            if rec.node == node and rec.state is NodeState.ACTIVE:
                told = f"node {node} excluded: {reason}"
                self._push(rec.agent_id, m.RoundChanged(round=job.round + 1, reason=told))
        job.apply([d.Exclude(node, reason)])

    def _apply(self, actions: Sequence[d.Action | Park]) -> None:
        for a in actions:
            if isinstance(a, Park):
                self.job.bench(a.node, a.reason, drained=True)
            elif isinstance(a, d.Exclude):
                self._exclude(a.node, a.reason)
            else:
                self.job.apply([a])
