"""The job master's executor: the node table, and the one place actions are carried out.

Transport-free: the server feeds it typed messages and gives it a ``push`` callable.  What to
do about an event is decided by the pure functions of :mod:`dlrover_hpc.master.decisions`;
this class applies their actions (records, messages to agents, the journal, events.jsonl and
the Slurm callbacks) and moves between the phases of :mod:`dlrover_hpc.master.phases` only
through that table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from dlrover_hpc.config import DrainMode, MasterConfig
from dlrover_hpc.events import EventName
from dlrover_hpc.master import crash_loop, resume
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.bookkeeping import JournaledCommits, PendingCharge
from dlrover_hpc.master.journal import EventLog, Journal
from dlrover_hpc.master.netcheck import NetcheckGate
from dlrover_hpc.master.nodes import (
    Clock,
    NodeRecord,
    NodeState,
    StoreFactory,
    rank_input,
    round_assignments,
)
from dlrover_hpc.master.phases import (
    ENDED,
    FORMING,
    TRANSITIONS,
    Phase,
    check_transition,
    ended_phase,
)
from dlrover_hpc.master.relaunch_plan import RelaunchBook
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.rendezvous.ranking import block_places, rank_nodes, segment_gain
from dlrover_hpc.rendezvous.state import (
    DecisionKind,
    RdzvParams,
    Waiter,
    decide,
    usable_count,
)

log = logging.getLogger(__name__)


Push = Callable[[str, m.Message], None]


#: A forming round's decision that took longer than this (thousands of waiting nodes) lets
#: COALESCE_FACTOR times its own time of joins come in before the next, at most COALESCE_MAX_S.
COALESCE_ABOVE_S, COALESCE_FACTOR, COALESCE_MAX_S = 0.002, 4.0, 0.25
#: A scale-up waiting for a checkpoint looks at the ranks' saved steps this often (heartbeats
#: bring them every few seconds; the master's pass over them is linear in the ranks).
SCALE_UP_POLL_S = 0.5


class Job:
    def __init__(
        self,
        config: MasterConfig,
        *,
        stores: StoreFactory,
        store_host: str,
        push: Push,
        topology: Any = None,
        clock: Clock = time.monotonic,
        events: EventLog | None = None,
        journal: Journal | None = None,
        remove_node: Callable[[str, str], None] | None = None,
        request_replacement: Callable[[int, list[str]], None] | None = None,
        requeue: Callable[[str], None] | None = None,
        relaunch: Callable[[d.Relaunch], None] | None = None,
    ) -> None:
        self.config = config
        self.params = RdzvParams(
            min_nodes=config.nnodes.min,
            max_nodes=config.nnodes.max,
            node_unit=config.node_unit,
            segment=config.segment,
            last_call_s=config.last_call_s,
            timeout_s=config.rendezvous_timeout_s,
        )
        self._stores, self._store_host, self._push = stores, store_host, push
        self._topology, self.clock = topology, clock
        self._events = events
        self._journal = journal
        self._remove_node = remove_node
        self._request_replacement, self._requeue = request_replacement, requeue
        self.can_replace, self.can_requeue = request_replacement is not None, requeue is not None
        self.capacity = d.Capacity()
        self._relaunch = relaunch
        self.relaunches = RelaunchBook()
        self.relaunching_possible = False  # set by the server when it runs under Slurm
        self._charge = PendingCharge(clock)
        #: rounds completed by this master process (a resumed one starts at 0, round does not)
        self.rounds_here = 0
        self.nodes: dict[str, NodeRecord] = {}
        #: WaitRounds outstanding (:meth:`count_wait`): at least the agents in rendezvous
        self.waits = 0
        self.phase = Phase.WAITING
        self._forming = Phase.WAITING  # the forming phase a network check returns to
        self.round = 0
        self.restart_count = 0
        self.exit_code: int | None = None
        self.finish_reason = ""
        self.excluded_nodes: set[str] = set()
        self._store_port = 0
        self._opened_at = clock()
        self._changed = asyncio.Event()
        self.commits = JournaledCommits(journal)
        self.recovery: resume.Recovery | None = None  # a restarted master's unsettled members
        self.finished = asyncio.Event()
        self._stop_signal = ""
        self.stopping = ""  # a graceful stop's kind and reason (time limit, preemption)
        self.last_committed = -1  # the newest checkpoint step committed in this process
        #: called as a round re-opens, before its agents are told (a pending straggler swap)
        self.on_round_opening: Callable[[], None] | None = None
        #: the running round's saved steps: (the oldest of each rank's newest step saved to
        #: memory, the newest step any rank reported); None: not every rank has reported
        self.saved_steps: Callable[[], tuple[int, int] | None] | None = None
        #: whether a node's ranks are shown to keep their peers' pace now (steps timed in the
        #: running round, none slow); None: nothing judges it (no node is then benched slow)
        self.keeps_pace: Callable[[str], bool] | None = None
        self._scale_up_wait: d.ScaleUpWait | None = None  # a scale-up put off to a checkpoint
        self._deferred_since: float | None = None  # ... for the round that takes the node in
        self._saw_save = False  # every rank of a round held a saved step: the job checkpoints
        #: the crash-loop guard (--crash-loop-rounds), and its verdict once it stopped the job
        self.loops = crash_loop.LoopWatch(config.crash_loop_rounds)
        self.crash_loop: d.CrashLoop | None = None
        self.netcheck = NetcheckGate(
            new_store=stores.new_store,
            store_host=store_host,
            timeout_s=config.netcheck_timeout_s,
            deliver=self._deliver,
            emit=self.emit,
            node_name=lambda agent: self.nodes[agent].node,
            clock=clock,
        )
        if journal is not None:
            self._resume(journal.load())
        resumed = {"resumed_round": self.round} if self.round else {}
        self.emit(EventName.JOB_STARTED, job_id=config.job_id, nnodes=str(config.nnodes), **resumed)

    # ------------------------------------------------------------ plumbing
    def emit(self, event: EventName, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(event, **fields)

    def _record(self, **fields: Any) -> None:
        if self._journal is not None:
            self._journal.append(**fields)

    def _resume(self, saved: dict[str, Any]) -> None:
        restored = resume.restore(saved, now=self.clock(), wall=time.time())
        if restored is None:
            return
        self.round, self.restart_count = restored.round, restored.restart_count
        self.excluded_nodes = set(restored.excluded_nodes)
        self.nodes.update((rec.agent_id, rec) for rec in restored.members)
        self.commits.replay(restored.ckpt_parts)
        if restored.members:  # its agents are (most likely) still training that round
            self._enter(Phase.RUNNING)
            self.recovery = restored.recovery

    def settle(self, rec: NodeRecord, how: str) -> None:
        """A member restored from the journal re-registered in its round, or did not."""
        recovery, rec.resumed = self.recovery if rec.resumed else None, False
        fields = recovery.settle(rec.node, how, now=time.time()) if recovery else None
        if fields is not None:
            self.recovery = None
            log.warning("master recovered %s", fields)
            self.emit(EventName.MASTER_RECOVERED, **fields)

    def participants(self) -> list[NodeRecord]:
        """The nodes ranked in the current round (whatever their state now)."""
        return [n for n in self.nodes.values() if n.round == self.round and n.rank >= 0]

    def active_agents(self) -> list[str]:
        """The agents of the current round whose workers run now: where a push to the
        round's workers goes (a persist, a stop, a swap's persist)."""
        return [n.agent_id for n in self.participants() if n.state is NodeState.ACTIVE]

    def spares(self) -> int:
        """Agents waiting in rendezvous now, outside the running round (hot spares)."""
        return len(self._waiting()) if self.phase is Phase.RUNNING else 0

    def can_swap_out(self) -> bool:
        """A node of the running round can go now: a hot spare waits to take its place, or
        the others are still enough and Slurm may give a replacement."""
        if self.spares() > 0:
            return True
        enough = len(self.participants()) - 1 >= self.config.nnodes.min
        return self.phase is Phase.RUNNING and enough and self.can_replace

    def _waiting(self) -> list[NodeRecord]:
        """Agents in rendezvous with a WaitRound outstanding."""
        return [
            n
            for n in self.nodes.values()
            if n.state is NodeState.WAITING and n.waiter is not None and not n.waiter.done()
        ]

    def count_wait(self, fut: asyncio.Future[m.Assignment]) -> None:
        """``fut`` is an agent's WaitRound, outstanding until it is done."""
        self.waits += 1
        fut.add_done_callback(self._wait_done)

    def _wait_done(self, _: asyncio.Future[m.Assignment]) -> None:
        self.waits -= 1

    def poke(self) -> None:
        self._changed.set()

    def request_stop(self, signal_name: str) -> None:
        """From a signal handler: only record it; :meth:`step` finishes the job."""
        self._stop_signal = signal_name
        self.poke()

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    def _deliver(self, agent_id: str, assignment: m.Assignment) -> None:
        rec = self.nodes[agent_id]
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.set_result(assignment)
        else:
            rec.pending = assignment

    # ------------------------------------------------------------ executor
    def apply(self, actions: Sequence[d.Action]) -> float | None:
        """Perform ``actions`` in order; returns the wake-up time of a WakeAt or StartNetcheck."""
        wake_at: float | None = None
        for action in actions:
            match action:
                case d.OpenRound(phase, reason):
                    self.open_round(phase, reason)
                case d.Finish(exit_code, reason):
                    self.finish(exit_code, reason)
                case d.CrashLoop(rounds, failure, failures):
                    self.crash_loop = action
                    log.error("crash loop rounds=%d failure=%s", rounds, failure)
                    self.emit(EventName.CRASH_LOOP, rounds=rounds, **failure, failures=failures)
                case d.CountRestart():
                    self.restart_count += 1
                    self._record(restart_count=self.restart_count)
                case d.ChargeLater(reason):
                    self._charge.later(reason)
                case d.Exclude(node, reason):
                    self.exclude(node, reason)
                case d.Bench(node, reason):
                    self.bench(node, reason)
                case d.RemoveNode(node, reason):
                    if self._remove_node is not None:
                        self._remove_node(node, reason)  # drain, or quarantine when refused
                case d.MarkLost(agent_id, reason):
                    self._lose(self.nodes[agent_id], reason)
                case d.RequestReplacement(count, avoid):
                    if self._request_replacement is not None:
                        self._request_replacement(count, list(avoid))
                case d.Relaunch() if self._relaunch is not None:
                    self._relaunch(action)  # srun in the allocation; node_relaunched
                case d.Requeue(reason):
                    if self._requeue is not None:
                        self._requeue(reason)
                case d.EnterPhase(phase):
                    self._enter(phase)
                case d.StartNetcheck(agents):
                    chosen = [self.nodes[a] for a in agents]
                    ranked = rank_nodes([rank_input(n) for n in chosen], self._topology)
                    self._forming = self.phase
                    self._enter(Phase.NETCHECK)
                    wake_at = self.netcheck.start([r.agent_id for r in ranked], self.round + 1)
                case d.CompleteRound(agents):
                    self._complete([self.nodes[a] for a in agents])
                case d.WakeAt(at):
                    wake_at = at
        return wake_at

    def _enter(self, phase: Phase) -> None:
        if phase is not self.phase:
            self.phase = check_transition(self.phase, phase)
            log.info("job phase=%s round=%d", phase, self.round)

    def _lose(self, rec: NodeRecord, reason: str) -> None:
        actions = d.node_lost(self.phase, self.round, rec, reason)
        if rec.state is NodeState.ACTIVE and rec.round == self.round:
            rank = rec.assignment.rank_offset if rec.assignment is not None else -1
            self.loops.tally.failed(
                crash_loop.Failure(
                    round=rec.round,
                    node=rec.node,
                    rank=rank,
                    classification=crash_loop.NODE_LOST,
                    error=reason,
                )
            )
        benched, rec.state = rec.state is NodeState.BENCHED, NodeState.LOST
        self.settle(rec, "lost")
        if not benched:  # a benched node was counted as a loss when it was benched
            self.capacity = self.capacity.lost()
        self.relaunches.last_loss_at = self.clock()
        self._charge.cancel()
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.cancel()
        log.warning("node lost node=%s agent=%s reason=%s", rec.node, rec.agent_id, reason)
        self.emit(EventName.NODE_LOST, node=rec.node, node_rank=rec.rank, reason=reason)
        self.apply(actions)
        self.poke()

    def exclude(self, node: str, reason: str) -> None:
        log.warning("node excluded node=%s reason=%s", node, reason)
        self.excluded_nodes.add(node)
        self._charge.cancel()  # a node left: a pending peer-lost charge was its symptom
        self._record(excluded_nodes=sorted(self.excluded_nodes))
        was_active = False
        for rec in self.nodes.values():
            if rec.node != node or rec.state is NodeState.EXCLUDED:
                continue
            was_active |= rec.state is NodeState.ACTIVE
            if rec.state is not NodeState.LOST:
                self.capacity = self.capacity.lost()
            rec.state = NodeState.EXCLUDED
            if rec.waiter is not None and not rec.waiter.done():
                rec.waiter.set_result(m.Assignment(status=m.NodeStatus.EXCLUDED, reason=reason))
        self.apply(d.excluded(self.phase, node, reason, was_active))

    def bench(self, node: str, reason: str, *, drained: bool = False) -> None:
        """A straggler's node leaves the rounds, its agent waiting: not a hot spare (the next
        fault takes a spare or a replacement instead, and a replacement is asked for as for a
        lost node), but taken back when a round would otherwise wait with fewer than MIN nodes
        (:meth:`_reserve`): a slow node trains, a missing one does not.  A ``drained`` node
        (Slurm's state) is never taken back: :meth:`unbench` makes it a spare once the drain
        is lifted."""
        was_active = False
        for rec in self.nodes.values():
            if rec.node != node or rec.state not in (NodeState.ACTIVE, NodeState.WAITING):
                continue
            was_active |= rec.state is NodeState.ACTIVE
            rec.state, rec.joined_at = NodeState.BENCHED, self.clock()
            rec.taken_back = False
            rec.drained = drained
            if drained:
                rec.reason = f"drained: {reason}"  # what status shows it waits for
            self.capacity = self.capacity.lost()
            if was_active:  # its workers stop now, not when the next round is complete
                told = f"node {node} benched: {reason}"
                self._push(rec.agent_id, m.RoundChanged(round=self.round + 1, reason=told))
        log.warning("node benched node=%s reason=%s", node, reason)
        self.apply(d.excluded(self.phase, node, reason, was_active, how="benched"))

    def unbench(self, node: str) -> bool:
        """The drained node's agents wait as hot spares again (its drain was lifted); False
        when none of them is benched for its drain any more (lost, excluded meanwhile)."""
        back = False
        for rec in self.nodes.values():
            if rec.node == node and rec.state is NodeState.BENCHED and rec.drained:
                rec.state, rec.joined_at = NodeState.WAITING, self.clock()
                rec.drained, rec.reason, back = False, "", True
        if back:
            log.warning("drained node back as a spare node=%s", node)
            self.poke()
        return back

    def _scale_up(self) -> float | None:
        """Take in nodes waiting while the round runs below MAX: at the next checkpoint (every
        rank saved a step newer than the newest one when they came, or one was committed), so
        the restart redoes no step; at once where the job saves no checkpoint the master sees,
        or with ``--scale-up-wait=0``; at the latest after ``--scale-up-wait``.  A fault
        meanwhile re-forms the round with them: one restart for both.  Returns when to look
        again."""
        ready = len(waiting := self._waiting())
        if self.params.segment > 1 and ready:  # only nodes that complete segments can come in
            running = [rank_input(n) for n in self.participants()]
            new = [rank_input(n) for n in waiting]
            ready = segment_gain(running, new, self._topology, self.params.segment)
        # no pass over every node's record twice a second while nobody waits
        actions = d.scale_up(self.participants(), ready, self.params) if ready else []
        if not actions:
            self._scale_up_wait = None
            return None
        now, limit = self.clock(), self.config.scale_up_wait_s
        steps = self.saved_steps() if self.saved_steps is not None else None
        self._saw_save |= steps is not None and steps[0] >= 0
        wait = self._scale_up_wait
        if wait is None:
            if not limit or not (self._saw_save or self.last_committed >= 0):
                self._grow(actions)  # no checkpoint to wait for
                return None
            newest = steps[1] if steps is not None else -1
            wait = self._scale_up_wait = d.ScaleUpWait(since=now, after_step=newest)
            log.info(
                "scale-up deferred to the next checkpoint after step %d (at most %g s)",
                wait.after_step,
                limit,
            )
        why = d.scale_up_due(
            wait,
            saved=steps[0] if steps is not None else None,
            committed=self.last_committed,
            now=now,
            limit_s=limit,
        )
        if why is None:
            return min(wait.since + limit, now + SCALE_UP_POLL_S)
        # open_round hands the wait's start on to the round's node_admitted
        reason = actions[0].reason if isinstance(actions[0], d.OpenRound) else "scale up"
        deferred = f"deferred {now - wait.since:.1f} s: {why}"
        self._grow([d.OpenRound(Phase.RENDEZVOUS, f"{reason} ({deferred})")], deferred)
        return None

    def _grow(self, actions: Sequence[d.Action], deferred: str = "") -> None:
        """Take the waiting nodes in (``actions``: the round that does it).  A benched straggler
        that a round short of MIN took back (:meth:`_reserve`) and that does not keep its
        peers' pace now is benched again in the same restart, a waiting node taking its place:
        a slow node trains only while no other can (soak seed 2: a node at a quarter speed,
        taken back at MIN 3, trained on beside the returning node; its restart took 4.7 s).
        Not with ``--segment``: a round takes whole segments, not one node for another."""
        waiting = len(self._waiting()) if self.params.segment <= 1 else 0
        slow = [
            rec
            for rec in sorted(self.participants(), key=lambda n: (n.joined_at, n.agent_id))
            if rec.taken_back and not (self.keeps_pace is not None and self.keeps_pace(rec.node))
        ][:waiting]
        if not slow:
            self.apply(actions)
            return
        why = "taken back at MIN, traded for a waiting node"
        for rec in slow:
            self.bench(rec.node, f"{why} ({deferred})" if deferred else why)

    def _short(self, waiting: int) -> bool:
        """``waiting`` nodes are too few for a round."""
        return usable_count(self.params, waiting) < self.params.min_nodes

    def _reserve(self, waiting: list[NodeRecord]) -> list[NodeRecord]:
        """Benched nodes a forming round takes back: fewer than MIN wait and nobody else is
        left to wait for; those benched longest first."""
        short = self.params.min_nodes - len(waiting)
        if short <= 0:
            return []
        benched = [
            n
            for n in self.nodes.values()
            if n.state is NodeState.BENCHED
            and not n.drained
            and n.disconnected_at is None
            and n.waiter is not None
            and not n.waiter.done()
        ]
        if not benched or len(waiting) < sum(1 for n in self.nodes.values() if d.reachable(n)):
            return []
        taken = sorted(benched, key=lambda n: (n.joined_at, n.agent_id))[:short]
        for rec in taken:
            rec.taken_back = True
            log.warning(
                "benched node taken back node=%s: the round would wait with %d of MIN %d nodes",
                rec.node,
                len(waiting),
                self.params.min_nodes,
            )
        return taken

    def open_round(self, phase: Phase, reason: str) -> None:
        """Stop the running round: every active agent stops its workers and re-joins."""
        if self._scale_up_wait is not None:  # a fault's round takes the waiting nodes in
            self._deferred_since, self._scale_up_wait = self._scale_up_wait.since, None
        self._enter(phase)
        self._opened_at = self.clock()
        if self.on_round_opening is not None:
            self.on_round_opening()
        next_round = self.round + 1
        log.info("rendezvous opened round=%d phase=%s reason=%s", next_round, phase, reason)
        for rec in self.nodes.values():
            if rec.state is NodeState.ACTIVE:
                self._push(rec.agent_id, m.RoundChanged(round=next_round, reason=reason))
            elif rec.state is NodeState.DONE:  # its workers ended, others did not: train again
                rec.state, rec.joined_at = NodeState.WAITING, self._opened_at
        self.poke()

    def finish(self, exit_code: int, reason: str) -> None:
        if self.ended:
            return
        phase = ended_phase(exit_code)
        if self.stopping and phase not in TRANSITIONS[self.phase]:
            # A graceful stop while a round forms (no worker ran to success): the job is
            # stopped, "failed" among the phases, though its exit code says it was continued.
            phase = Phase.FAILED
        self._enter(phase)
        if self.stopping and not reason.startswith(self.stopping):
            reason = f"{self.stopping}; {reason}"
        self.exit_code, self.finish_reason = exit_code, reason
        log.info("job finished exit_code=%d reason=%s", exit_code, reason)
        self._record(finished=True, exit_code=exit_code)
        stored = d.durability(list(self.nodes.values()))
        checkpoint = (
            {
                "checkpoint_step": max(w for w, _, _ in stored.values()),
                "durable_step": min(c for _, c, _ in stored.values()),
            }
            if stored
            else {}
        )
        self.emit(
            EventName.JOB_FINISHED,
            exit_code=exit_code,
            reason=reason,
            restart_count=self.restart_count,
            **checkpoint,
            **self._repeated_failure(),
        )
        for rec in self.nodes.values():
            if rec.waiter is not None and not rec.waiter.done():
                rec.waiter.set_result(self.finished_assignment())
            if rec.state is NodeState.ACTIVE:
                self._push(rec.agent_id, m.RoundChanged(round=self.round + 1, reason=reason))
        self.finished.set()

    def _repeated_failure(self) -> dict[str, Any]:
        """job_finished's account of a crash loop: the failure that repeated."""
        if self.crash_loop is None:
            return {}
        return {"repeated_failure": {"rounds": self.crash_loop.rounds, **self.crash_loop.failure}}

    def loop_facts(self) -> dict[str, Any]:
        """What the crash-loop guard weighs besides its tally (:class:`crash_loop.LoopWatch`)."""
        return {
            "world_size": sum(n.nproc for n in self.participants()),
            "committed": self.last_committed,
            "usable": {n.node for n in self.nodes.values() if n.state in d.USABLE},
            "min_nodes": self.params.min_nodes,
            "excluded": self.excluded_nodes,
        }

    def loop_now(self) -> list[d.Action]:
        """The guard's word if the running round failed the job now (``d.charge``'s loop)."""
        return self.loops.failing_now(**self.loop_facts())

    def finished_assignment(self) -> m.Assignment:
        return m.Assignment(
            status=m.NodeStatus.FINISHED, exit_code=self.exit_code or 0, reason=self.finish_reason
        )

    # ------------------------------------------------------------ the loop
    def step(self) -> float | None:
        """Apply the rendezvous decision; returns when to call again (monotonic) or None."""
        if self._stop_signal:
            self.finish(143, f"the master received {self._stop_signal}")
            return None
        if self._charge.due() is not None:
            self.apply(
                d.charge(
                    restart_count=self.restart_count,
                    max_restarts=self.config.max_restarts,
                    loop=self.loop_now(),
                )
            )
        if self.ended:
            return None
        scale_up_at = None
        if self.phase is Phase.RUNNING and self.recovery is None:
            scale_up_at = self._scale_up()
        if self.phase is Phase.NETCHECK:
            removals = self.netcheck.poll()
            if removals is None:
                return self.netcheck.run.deadline if self.netcheck.run else None
            self._enter(self._forming)
            for agent, reason in removals.items():
                node = self.nodes[agent].node
                self.exclude(node, reason)
                if self._remove_node is not None and self.config.drain is not DrainMode.OFF:
                    self._remove_node(node, reason)
        if self.phase not in FORMING:
            return scale_up_at
        if not self._stores.ready():
            # torch is still importing in the background (many seconds on a loaded node): a
            # round formed now would block the event loop in new_store, heartbeats and SSH
            # keepalives unanswered (cc23, cc30: every agent of a job lost at once). Next tick.
            return None
        waiting: list[NodeRecord] = []
        if not self._short(self.waits):  # else: no pass over the nodes can find enough
            waiting = self._waiting()
            waiting += self._reserve(waiting)
        if self._short(len(waiting)):
            # Too few for a round: only the rendezvous timeout can be due, and it needs no
            # pass over the nodes (a step per join while 16,384 agents come in: quadratic).
            decision = decide(
                params=self.params,
                waiting=(),
                alive=0,
                opened_at=self._opened_at,
                now=self.clock(),
            )
            return self.apply(d.form_round(decision, params=self.params, needs_netcheck=False))
        ids = {n.agent_id for n in waiting}  # not `n in waiting`: quadratic at 16k nodes
        places: dict[str, tuple[str, int]] = {}
        if self.params.segment > 1:  # --segment: whole segments, each inside one block
            places = block_places([rank_input(n) for n in waiting], self._topology)
        decision = decide(
            params=self.params,
            waiting=[
                Waiter(
                    agent_id=n.agent_id,
                    joined_at=n.joined_at,
                    was_active=n.round == self.round and n.rank >= 0,
                    block=places.get(n.agent_id, ("", 0))[0],
                    order=places.get(n.agent_id, ("", 0))[1],
                )
                for n in waiting
            ],
            # A disconnected agent is not waited for: if it reconnects, it re-joins.
            alive=sum(1 for n in self.nodes.values() if d.reachable(n) or n.agent_id in ids),
            returning=sum(
                1 for n in self.participants() if d.reachable(n) and n.agent_id not in ids
            ),
            initial=self.round == 0,
            opened_at=self._opened_at,
            now=self.clock(),
        )
        # The ended round is judged before the next forms (crash_loop): a crash loop ends the
        # job; a node excluded for it leaves, and the next step forms the round without it.
        complete = decision.kind is DecisionKind.COMPLETE
        if complete and (loop := self.loops.round_ended(**self.loop_facts())):
            self.apply(loop)
            self.poke()
            return None
        needs = self.netcheck.needs_check(decision.chosen, self.round + 1)
        return self.apply(d.form_round(decision, params=self.params, needs_netcheck=needs))

    def _complete(self, chosen: list[NodeRecord]) -> None:
        previous = {n.agent_id for n in self.participants()}
        first_round = self.round == 0 or not previous
        self.round += 1
        self.rounds_here += 1
        self.loops.tally.begin(self.round)
        ranked = rank_nodes([rank_input(n) for n in chosen], self._topology)
        self._store_port = self._stores.new_store(self.round)
        self.commits.new_generation()
        restarts = self.restart_count + self._charge.pending
        assignments = round_assignments(
            [self.nodes[r.agent_id] for r in ranked],
            round=self.round,
            store_host=self._store_host,
            store_port=self._store_port,
            restart_count=restarts,
            max_restarts=self.config.max_restarts,
            run_id=self.config.job_id,
        )
        names = [r.node for r in ranked]
        # A scale-up put off to a checkpoint (or taken in by a fault's round meanwhile).
        since, self._deferred_since = self._deferred_since, None
        deferred: dict[str, Any] = {"deferred": since is not None}
        if since is not None:
            deferred["deferred_s"] = round(self.clock() - since, 3)
        for rank, (r, assignment) in enumerate(zip(ranked, assignments, strict=True)):
            rec = self.nodes[r.agent_id]
            rec.state, rec.rank, rec.round = NodeState.ACTIVE, rank, self.round
            rec.assignment = assignment
            if rec.waiter is not None and not rec.waiter.done():
                rec.waiter.set_result(assignment)
            if not first_round and rec.agent_id not in previous:
                self.emit(
                    EventName.NODE_ADMITTED,
                    node=rec.node,
                    node_rank=rank,
                    round=self.round,
                    **deferred,
                )
        for rec in self.nodes.values():  # not chosen: hot spares keep waiting
            if rec.state is NodeState.ACTIVE and rec.round != self.round:
                rec.state = NodeState.WAITING
        self._enter(Phase.RUNNING)
        self._record(
            round=self.round,
            restart_count=self.restart_count,
            members=[resume.member_row(self.nodes[r.agent_id]) for r in ranked],
        )
        log.info("rendezvous complete round=%d nodes=%s", self.round, ",".join(names))
        segments: dict[str, Any] = {}
        if self.params.segment > 1:  # each rank's block: a segment's nodes share one
            block_of = self._topology.leaf_of() if self._topology is not None else {}
            blocks = [block_of.get(name, "") for name in names]
            segments = {"segment": self.params.segment, "blocks": blocks}
            log.info(
                "segments round=%d segment=%d blocks=%s",
                self.round,
                self.params.segment,
                ",".join(blocks),
            )
        self.emit(
            EventName.RENDEZVOUS_COMPLETE,
            round=self.round,
            nodes=names,
            world_size=assignments[0].world_size,
            restart_count=restarts,
            **segments,
        )
        if self.round > 1 and not first_round:
            self.emit(EventName.WORKERS_RESTARTED, round=self.round, restart_count=restarts)

    async def run(self) -> None:
        """Re-evaluate on every change and on timers until the job finishes."""
        while not self.finished.is_set():
            self._changed.clear()
            forming = self.phase in FORMING
            began = time.perf_counter()
            wake_at = self.step()
            took = time.perf_counter() - began
            timeout = 1.0 if wake_at is None else max(0.0, min(1.0, wake_at - self.clock()))
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
            if forming and took > COALESCE_ABOVE_S:
                # Agents join by the thousand: each join pokes, and a forming round's decision
                # passes over every waiting node.  Let the joins of a few decisions' time come
                # in first, so decisions take a fifth of the loop, not all of it.
                await asyncio.sleep(min(COALESCE_MAX_S, COALESCE_FACTOR * took))
