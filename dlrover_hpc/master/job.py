"""The job master's state: node table, rendezvous rounds, failure policy, checkpoint commits.

Transport-free: the server feeds it typed messages and gives it a ``push`` callable; every
change of state is logged once, journaled, and written to events.jsonl.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from dlrover_hpc.config import DrainMode, MasterConfig
from dlrover_hpc.master.commits import CommitCounter
from dlrover_hpc.master.journal import EventLog, Journal
from dlrover_hpc.master.netcheck import NetcheckGate
from dlrover_hpc.master.nodes import (
    Clock,
    JobState,
    NodeRecord,
    NodeState,
    StoreFactory,
    rank_input,
)
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.rendezvous.ranking import rank_nodes
from dlrover_hpc.rendezvous.state import DecisionKind, RdzvParams, Waiter, decide, usable_count

log = logging.getLogger(__name__)


Push = Callable[[str, m.Message], None]


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
    ) -> None:
        self.config = config
        self.params = RdzvParams(
            min_nodes=config.nnodes.min,
            max_nodes=config.nnodes.max,
            node_unit=config.node_unit,
            last_call_s=config.last_call_s,
            timeout_s=config.rendezvous_timeout_s,
        )
        self._stores, self._store_host, self._push = stores, store_host, push
        self._topology, self._clock = topology, clock
        self._events = events
        self._journal = journal
        self._remove_node = remove_node
        self._request_replacement, self._requeue = request_replacement, requeue
        self._losses = 0  # nodes lost or excluded so far
        self._losses_replaced = 0  # ... for which replacements were requested
        self._below_min_since: float | None = None
        #: rounds completed by this master process (a resumed one starts at 0, round does not)
        self._rounds_here = 0
        self.nodes: dict[str, NodeRecord] = {}
        self.state = JobState.RENDEZVOUS
        self.round = 0
        self.restart_count = 0
        self.exit_code: int | None = None
        self.finish_reason = ""
        self.excluded_nodes: set[str] = set()
        self._store_port = 0
        self._opened_at = clock()
        self._ids = itertools.count(1)
        self._changed = asyncio.Event()
        self.commits = CommitCounter()
        self.finished = asyncio.Event()
        self._stop_signal = ""
        self.netcheck = NetcheckGate(
            new_store=stores.new_store,
            store_host=store_host,
            timeout_s=config.netcheck_timeout_s,
            deliver=self._deliver,
            emit=self._emit,
            node_name=lambda agent: self.nodes[agent].node,
            clock=clock,
        )
        if journal is not None:
            self._resume(journal.load())
        self._emit("job_started", job_id=config.job_id, nnodes=str(config.nnodes))

    # ------------------------------------------------------------ plumbing
    def _emit(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(event, **fields)

    def _record(self, **fields: Any) -> None:
        if self._journal is not None:
            self._journal.append(**fields)

    def _resume(self, saved: dict[str, Any]) -> None:
        if not saved:
            return
        self.round = int(saved.get("round", 0))
        self.restart_count = int(saved.get("restart_count", 0))
        self.excluded_nodes = set(saved.get("excluded_nodes", []))
        log.info(
            "master resumed from journal round=%d restarts=%d excluded=%s",
            self.round,
            self.restart_count,
            sorted(self.excluded_nodes),
        )

    def _participants(self) -> list[NodeRecord]:
        """The nodes ranked in the current round (whatever their state now)."""
        return [n for n in self.nodes.values() if n.round == self.round and n.rank >= 0]

    def _waiting(self) -> list[NodeRecord]:
        """Agents in rendezvous with a WaitRound outstanding."""
        return [
            n
            for n in self.nodes.values()
            if n.state is NodeState.WAITING and n.waiter is not None and not n.waiter.done()
        ]

    def poke(self) -> None:
        self._changed.set()

    def request_stop(self, signal_name: str) -> None:
        """From a signal handler: only record it; :meth:`step` finishes the job."""
        self._stop_signal = signal_name
        self.poke()

    # ------------------------------------------------------------ handlers
    def join(self, msg: m.Join) -> m.JoinReply:
        now = self._clock()
        agent_id = msg.agent_id or f"{msg.node}-{next(self._ids)}"
        excluded = msg.node in self.excluded_nodes
        rec = NodeRecord(
            agent_id=agent_id,
            node=msg.node,
            addr=msg.addr,
            nproc=msg.nproc,
            slurm_node_id=msg.slurm_node_id,
            topology_addr=msg.topology_addr,
            state=NodeState.EXCLUDED if excluded else NodeState.WAITING,
            joined_at=now,
            last_seen=now,
        )
        self.nodes[agent_id] = rec
        self.netcheck.enabled |= msg.network_check  # any agent's --network-check turns it on
        self.netcheck.exclude_straggler |= msg.exclude_straggler
        log.info("agent joined agent=%s node=%s excluded=%s", agent_id, msg.node, excluded)
        if self.state is JobState.RUNNING and not excluded:
            log.info("spare waiting agent=%s", agent_id)
        self.poke()
        return m.JoinReply(
            agent_id=agent_id,
            job_id=self.config.job_id,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
        )

    def wait_round(self, msg: m.WaitRound) -> asyncio.Future[m.Assignment]:
        rec = self._record_of(msg.agent_id)
        fut: asyncio.Future[m.Assignment] = asyncio.get_running_loop().create_future()
        if self.state is JobState.FINISHED:
            fut.set_result(self._finished_assignment())
            return fut
        if rec.state is NodeState.EXCLUDED:
            fut.set_result(
                m.Assignment(
                    status=m.NodeStatus.EXCLUDED.value,
                    reason=f"node {rec.node} is excluded from this job",
                )
            )
            return fut
        if rec.state is NodeState.ACTIVE and rec.round > msg.after_round and rec.assignment:
            fut.set_result(rec.assignment)  # it asked again (e.g. after a reconnect)
            return fut
        if rec.state is NodeState.DONE and self.state is JobState.RUNNING:
            pass  # finished its part: waits for the job's end (or a new round, see open_round)
        elif rec.state in (NodeState.ACTIVE, NodeState.DONE, NodeState.LOST):
            rec.state = NodeState.WAITING  # it stopped its workers and re-joins
            rec.joined_at = self._clock()
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.cancel()
        if rec.pending is not None:  # a network-check task handed out while it was busy
            fut.set_result(rec.pending)
            rec.pending = None
            return fut
        rec.waiter = fut
        self.poke()
        return fut

    def _deliver(self, agent_id: str, assignment: m.Assignment) -> None:
        rec = self.nodes[agent_id]
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.set_result(assignment)
        else:
            rec.pending = assignment

    def netcheck_report(self, msg: m.NetcheckReport) -> m.Ack:
        self._record_of(msg.agent_id)
        self.netcheck.report(msg.agent_id, msg)
        self.poke()
        return m.Ack()

    def heartbeat(self, msg: m.Heartbeat) -> m.HeartbeatReply:
        rec = self._record_of(msg.agent_id)
        rec.last_seen = self._clock()
        rec.disconnected_at = None
        return m.HeartbeatReply(round=self.round, finished=self.state is JobState.FINISHED)

    def workers_started(self, msg: m.WorkersStarted) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        self._emit(
            "workers_started",
            node=rec.node,
            node_rank=rec.rank,
            round=msg.round,
            pids=msg.pids,
            restart_count=self.restart_count,
        )
        return m.Ack()

    def worker_failed(self, msg: m.WorkerFailed) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        self._emit(
            "worker_failed",
            node=rec.node,
            node_rank=rec.rank,
            round=msg.round,
            local_rank=msg.local_rank,
            rank=msg.rank,
            exit_code=msg.exit_code,
            signal=msg.signal,
            classification=msg.classification,
            reason=msg.reason,
        )
        if msg.classification == "hardware" and self.config.drain is not DrainMode.OFF:
            # Even when a peer's failure already opened the next round (a dying rank often
            # takes its peers down first): the faulty node must not be admitted again.
            reason = f"hardware fault on rank {msg.rank}: {msg.reason[:120]}"
            self.exclude(rec.node, reason)
            if self._remove_node is not None:
                self._remove_node(rec.node, reason)  # drain, or quarantine when refused
        if msg.round != self.round or self.state is not JobState.RUNNING:
            return m.Ack()  # this round is already being replaced: charge the budget once
        self.restart_count += 1
        self._record(restart_count=self.restart_count)
        log.warning(
            "worker failed node=%s local_rank=%d exit=%s signal=%s kind=%s restarts=%d/%d",
            rec.node,
            msg.local_rank,
            msg.exit_code,
            msg.signal,
            msg.classification,
            self.restart_count,
            self.config.max_restarts,
        )
        if self.restart_count > self.config.max_restarts:
            self.finish(
                1, f"worker failed and the job's {self.config.max_restarts} restarts are used up"
            )
        else:
            self.open_round(f"worker {msg.rank} on {rec.node} failed")
        return m.Ack()

    def workers_succeeded(self, msg: m.WorkersSucceeded) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        if msg.round == self.round and rec.state is NodeState.ACTIVE:
            rec.state = NodeState.DONE
            log.info("workers succeeded node=%s rank=%d", rec.node, rec.rank)
            participants = self._participants()
            if self.state is JobState.RUNNING and all(
                n.state is NodeState.DONE for n in participants
            ):
                self.finish(0, "all workers succeeded")
        return m.Ack()

    def checkpoint_part(self, msg: m.CheckpointPart) -> m.CheckpointCommit:
        return m.CheckpointCommit(commit=self.commits.part_durable(msg))

    def status(self) -> m.StatusReply:
        return m.StatusReply(
            job_id=self.config.job_id,
            state=self.state.value,
            round=self.round,
            restart_count=self.restart_count,
            max_restarts=self.config.max_restarts,
            nodes=[
                {
                    "agent_id": n.agent_id,
                    "node": n.node,
                    "rank": n.rank,
                    "state": n.state.value,
                    "round": n.round,
                    "nproc": n.nproc,
                }
                for n in sorted(self.nodes.values(), key=lambda n: (n.rank < 0, n.rank, n.node))
            ],
        )

    # --------------------------------------------------------- transitions
    def disconnected(self, agent_id: str) -> None:
        rec = self.nodes.get(agent_id)
        if rec is not None and rec.state not in (NodeState.LOST, NodeState.EXCLUDED):
            rec.disconnected_at = self._clock()
            self.poke()

    def check_liveness(self) -> None:
        now = self._clock()
        grace = min(self.config.heartbeat_timeout_s, 3.0)
        for rec in list(self.nodes.values()):
            if rec.state in (NodeState.LOST, NodeState.EXCLUDED, NodeState.DONE):
                continue
            silent = now - rec.last_seen > self.config.heartbeat_timeout_s
            gone = rec.disconnected_at is not None and now - rec.disconnected_at > grace
            if silent or gone:
                self.node_lost(rec, "no heartbeat" if silent else "connection closed")

    def check_capacity(self) -> None:
        """After hot spares: ask for a replacement job; below MIN for too long: requeue.

        Only once this master process has completed a rendezvous: a master resumed from its
        journal waits for its agents to reach it, as a fresh one does."""
        if self.state is JobState.FINISHED or self._rounds_here == 0:
            return
        now = self._clock()
        usable = (NodeState.WAITING, NodeState.ACTIVE, NodeState.DONE)
        alive = [n for n in self.nodes.values() if n.state in usable]
        if (
            self._losses > self._losses_replaced
            and len(alive) < self.params.max_nodes
            and self._request_replacement is not None
        ):
            self._losses_replaced = self._losses
            # Not on a node this job holds or has given up: Slurm shares nodes by default.
            avoid = {n.node for n in self.nodes.values()} | self.excluded_nodes
            self._request_replacement(self.params.max_nodes - len(alive), sorted(avoid))
        if len(alive) >= self.params.min_nodes:
            self._below_min_since = None
            return
        if self._below_min_since is None:
            self._below_min_since = now
        waited = now - self._below_min_since
        if waited >= self.config.min_nodes_timeout_s and self._requeue is not None:
            reason = f"fewer than {self.params.min_nodes} nodes for {waited:.0f} s"
            self._requeue(reason)
            self.finish(1, f"requeued: {reason}")

    def _scale_up(self) -> None:
        """Running below MAX and new agents (replacements) wait: take them in."""
        current = self._participants()
        if any(n.state is not NodeState.ACTIVE for n in current):
            return
        ready = self._waiting()
        if ready and usable_count(self.params, len(current) + len(ready)) > len(current):
            self.open_round(f"scale up: {len(ready)} more node(s) waiting")

    def node_lost(self, rec: NodeRecord, reason: str) -> None:
        was_active = rec.state is NodeState.ACTIVE and rec.round == self.round
        rec.state = NodeState.LOST
        self._losses += 1
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.cancel()
        log.warning("node lost node=%s agent=%s reason=%s", rec.node, rec.agent_id, reason)
        self._emit("node_lost", node=rec.node, node_rank=rec.rank, reason=reason)
        if was_active and self.state is JobState.RUNNING:
            self.open_round(f"node {rec.node} lost ({reason})")
        self.poke()

    def exclude(self, node: str, reason: str) -> None:
        self.excluded_nodes.add(node)
        self._record(excluded_nodes=sorted(self.excluded_nodes))
        for rec in self.nodes.values():
            if rec.node == node and rec.state is not NodeState.EXCLUDED:
                active = rec.state is NodeState.ACTIVE
                if rec.state is not NodeState.LOST:
                    self._losses += 1
                rec.state = NodeState.EXCLUDED
                if rec.waiter is not None and not rec.waiter.done():
                    rec.waiter.set_result(
                        m.Assignment(status=m.NodeStatus.EXCLUDED.value, reason=reason)
                    )
                if active and self.state is JobState.RUNNING:
                    self.open_round(f"node {node} excluded: {reason}")

    def open_round(self, reason: str) -> None:
        """Stop the running round: every active agent stops its workers and re-joins."""
        self.state = JobState.RENDEZVOUS
        self._opened_at = self._clock()
        next_round = self.round + 1
        log.info("rendezvous opened round=%d reason=%s", next_round, reason)
        for rec in self.nodes.values():
            if rec.state is NodeState.ACTIVE:
                self._push(rec.agent_id, m.RoundChanged(round=next_round, reason=reason))
            elif rec.state is NodeState.DONE:  # its workers ended, others did not: train again
                rec.state, rec.joined_at = NodeState.WAITING, self._opened_at
        self.poke()

    def finish(self, exit_code: int, reason: str) -> None:
        if self.state is JobState.FINISHED:
            return
        self.state, self.exit_code, self.finish_reason = JobState.FINISHED, exit_code, reason
        log.info("job finished exit_code=%d reason=%s", exit_code, reason)
        self._record(finished=True, exit_code=exit_code)
        self._emit(
            "job_finished", exit_code=exit_code, reason=reason, restart_count=self.restart_count
        )
        for rec in self.nodes.values():
            if rec.waiter is not None and not rec.waiter.done():
                rec.waiter.set_result(self._finished_assignment())
            if rec.state is NodeState.ACTIVE:
                self._push(rec.agent_id, m.RoundChanged(round=self.round + 1, reason=reason))
        self.finished.set()

    def _finished_assignment(self) -> m.Assignment:
        return m.Assignment(
            status=m.NodeStatus.FINISHED.value,
            exit_code=self.exit_code or 0,
            reason=self.finish_reason,
        )

    # ----------------------------------------------------------- the loop
    def step(self) -> float | None:
        """Apply the rendezvous decision; returns when to call again (monotonic) or None."""
        if self._stop_signal:
            self.finish(143, f"the master received {self._stop_signal}")
            return None
        if self.state is JobState.RUNNING:
            self._scale_up()
        if self.state is not JobState.RENDEZVOUS:
            return None
        if self.netcheck.run is not None:
            removals = self.netcheck.poll()
            if removals is None:
                return self.netcheck.run.deadline
            for agent, reason in removals.items():
                node = self.nodes[agent].node
                self.exclude(node, reason)
                if self._remove_node is not None and self.config.drain is not DrainMode.OFF:
                    self._remove_node(node, reason)
        now = self._clock()
        waiting = self._waiting()
        alive = [n for n in self.nodes.values() if n.state in (NodeState.WAITING, NodeState.ACTIVE)]
        decision = decide(
            params=self.params,
            waiting=[
                Waiter(
                    agent_id=n.agent_id,
                    joined_at=n.joined_at,
                    was_active=n.round == self.round and n.rank >= 0,
                )
                for n in waiting
            ],
            alive=len(alive),
            initial=self.round == 0,
            opened_at=self._opened_at,
            now=now,
        )
        if decision.kind is DecisionKind.COMPLETE:
            chosen = [self.nodes[a] for a in decision.chosen]
            if self.netcheck.needs_check(decision.chosen, self.round + 1):
                ranked = rank_nodes([rank_input(n) for n in chosen], self._topology)
                return self.netcheck.start([r.agent_id for r in ranked], self.round + 1)
            self._complete(chosen)
            return None
        if decision.kind is DecisionKind.TIMEOUT:
            self.finish(
                1, f"fewer than {self.params.min_nodes} nodes for {self.params.timeout_s:.0f} s"
            )
            return None
        return decision.wake_at

    def _complete(self, chosen: list[NodeRecord]) -> None:
        previous = {n.agent_id for n in self._participants()}
        first_round = self.round == 0 or not previous
        self.round += 1
        self._rounds_here += 1
        ranked = rank_nodes([rank_input(n) for n in chosen], self._topology)
        self._store_port = self._stores.new_store(self.round)
        self.commits.new_generation()
        world = sum(n.nproc for n in chosen)
        names = [r.node for r in ranked]
        offset = 0
        for rank, r in enumerate(ranked):
            rec = self.nodes[r.agent_id]
            rec.state, rec.rank, rec.round = NodeState.ACTIVE, rank, self.round
            assignment = m.Assignment(
                status=m.NodeStatus.ACTIVE.value,
                round=self.round,
                node_rank=rank,
                nnodes=len(ranked),
                world_size=world,
                rank_offset=offset,
                store_host=self._store_host,
                store_port=self._store_port,
                restart_count=self.restart_count,
                max_restarts=self.config.max_restarts,
                run_id=self.config.job_id,
            )
            offset += rec.nproc
            rec.assignment = assignment
            if rec.waiter is not None and not rec.waiter.done():
                rec.waiter.set_result(assignment)
            if not first_round and rec.agent_id not in previous:
                self._emit("node_admitted", node=rec.node, node_rank=rank, round=self.round)
        for rec in self.nodes.values():  # not chosen: hot spares keep waiting
            if rec.state is NodeState.ACTIVE and rec.round != self.round:
                rec.state = NodeState.WAITING
        self.state = JobState.RUNNING
        self._record(round=self.round, restart_count=self.restart_count)
        log.info("rendezvous complete round=%d nodes=%s", self.round, ",".join(names))
        self._emit(
            "rendezvous_complete",
            round=self.round,
            nodes=names,
            world_size=world,
            restart_count=self.restart_count,
        )
        if self.round > 1 and not first_round:
            self._emit("workers_restarted", round=self.round, restart_count=self.restart_count)

    def _record_of(self, agent_id: str) -> NodeRecord:
        rec = self.nodes.get(agent_id)
        if rec is None:
            raise KeyError(f"unknown agent {agent_id!r}; join first")
        return rec

    async def run(self) -> None:
        """Re-evaluate on every change and on timers until the job finishes."""
        while not self.finished.is_set():
            self._changed.clear()
            wake_at = self.step()
            timeout = 1.0 if wake_at is None else max(0.0, min(1.0, wake_at - self._clock()))
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._changed.wait()
