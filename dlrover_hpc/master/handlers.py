"""What the master does with each agent message and each liveness tick.

The server's handler table maps every request type to a method here.  A handler updates the
node record the message is about and hands the decision to :mod:`dlrover_hpc.master.decisions`;
:class:`dlrover_hpc.master.job.Job` carries out the resulting actions.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time

from dlrover_hpc.events import EventName
from dlrover_hpc.master import crash_loop
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.nodes import NodeRecord, NodeState, node_rows, summary_rows
from dlrover_hpc.master.phases import FORMING, Phase
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)
WAITING_SAY_S = 10.0
#: Up to this many nodes, every liveness tick looks at every node; beyond, the pass for
#: silent agents runs every :data:`SILENCE_PASSES`-th of the silence timeout (1.5 s at 4,096
#: nodes, whose timeout is 24 s), and the ticks between look at disconnected agents only.
EVERY_TICK_NODES = 256
SILENCE_PASSES = 16


class AgentHandlers:
    def __init__(self, job: Job, hangs: HangWatch | None = None) -> None:
        self.job = job
        self.hangs = hangs
        self.steps = StepLog(job.emit)
        self._ids = itertools.count(1)
        self._world = (-1, 0)  # (round, its world size)
        self._waiting_since: float | None = None
        self._said_at = 0.0
        self._silence_pass_at: float | None = None  # the newest liveness pass over every node
        self._disconnected: set[str] = set()  # agents disconnected since (checked every tick)

    def _record_of(self, agent_id: str) -> NodeRecord:
        rec = self.job.nodes.get(agent_id)
        if rec is None:
            raise KeyError(f"unknown agent {agent_id!r}; join first")
        return rec

    # ------------------------------------------------------------ messages
    def status(self, msg: m.StatusRequest | None = None) -> m.StatusReply:
        job, steps = self.job, self.steps
        rows = [
            dataclasses.replace(row, step=steps.node_steps.get(row.node, -1))
            if row.round == steps.round and row.state in (NodeState.ACTIVE, NodeState.DONE)
            else row
            for row in node_rows(job.nodes.values())
        ]
        states = collections.Counter(str(r.state) for r in rows)
        stragglers = self.hangs.straggler_nodes() if self.hangs is not None else []
        summary = msg is not None and not msg.nodes and len(rows) > m.SUMMARY_OVER
        if summary:
            rows = summary_rows(rows, set(stragglers))
        return m.StatusReply(
            job_id=job.config.job_id,
            state=job.phase.value,
            round=job.round,
            restart_count=job.restart_count,
            max_restarts=job.config.max_restarts,
            nodes=rows,
            step=steps.step,
            step_rate=round(steps.step_rate(), 3),
            summary=summary,
            node_states=dict(states),
            stragglers=stragglers,
        )

    def join(self, msg: m.Join) -> m.JoinReply:
        known = self.job.nodes.get(msg.agent_id) if msg.agent_id else None
        if known is not None and known.node == msg.node:
            if known.resumed:
                self._adopt(known, msg)
            else:
                self._rejoin(known)
            return self._join_reply(known.agent_id)
        now = self.job.clock()
        agent_id = msg.agent_id or f"{msg.node}-{next(self._ids)}"
        excluded = msg.node in self.job.excluded_nodes
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
            launch_argv=tuple(msg.launch_argv),
            launch_cwd=msg.launch_cwd,
            replica_port=msg.replica_port,
        )
        self.job.nodes[agent_id] = rec
        self.job.relaunches.joined(msg.node)
        self.job.netcheck.enabled |= msg.network_check  # any agent's --network-check turns it on
        self.job.netcheck.exclude_straggler |= msg.exclude_straggler
        if self.hangs is not None:
            self.hangs.joined(msg)
        log.info("agent joined agent=%s node=%s excluded=%s", agent_id, msg.node, excluded)
        self.job.emit(EventName.NODE_JOINED, node=msg.node, agent=agent_id, excluded=excluded)
        if self.job.phase is Phase.RUNNING and not excluded:
            log.info("spare waiting agent=%s", agent_id)
        self.job.poke()
        return self._join_reply(agent_id)

    def _join_reply(self, agent_id: str) -> m.JoinReply:
        return m.JoinReply(
            agent_id=agent_id,
            job_id=self.job.config.job_id,
            heartbeat_interval_s=self.job.config.heartbeat_every_s,
            job_running=self.job.round > 0,
            link_timeout_s=self.job.config.link_timeout_in_use_s,
        )

    def _rejoin(self, rec: NodeRecord) -> None:
        """A known agent connected again (its link came back, or its connection was reset).

        While the master still counts it, nothing changes: its workers train on.  When it
        was already lost, the round went on without it: it comes back as a waiting node
        (``node_readmitted``), is probed again by the network check when that is on, and
        joins at the next rendezvous; the heartbeat reply tells it to stop its old workers.
        Unless Slurm took its node out of the job while it was away (a ``--no-kill`` job loses
        a node that stops answering for SlurmdTimeout): slurmd ends the agent's step there
        once it registers again, so the agent is told to exit instead of training a round
        and dying in it (a second stall for the same fault).
        """
        lost_since = rec.last_seen if rec.disconnected_at is None else rec.disconnected_at
        rec.last_seen = self.job.clock()
        rec.disconnected_at, rec.link_timed_out = None, False
        if rec.state is not NodeState.LOST:
            log.info(
                "agent reconnected agent=%s node=%s state=%s", rec.agent_id, rec.node, rec.state
            )
            return
        if self.job.ended or rec.node in self.job.excluded_nodes:
            return
        book = self.job.relaunches
        if (
            self.job.relaunching_possible
            and book.allocation is not None
            and book.allocation_at >= lost_since
            and rec.node not in book.allocation
        ):
            rec.left_job = True
            log.warning(
                "node not readmitted node=%s agent=%s reason=Slurm took it out of the job "
                "while it was lost",
                rec.node,
                rec.agent_id,
            )
            return
        rec.state, rec.joined_at = NodeState.WAITING, rec.last_seen
        self.job.netcheck.forget(rec.agent_id)
        log.warning("node readmitted node=%s agent=%s", rec.node, rec.agent_id)
        self.job.emit(EventName.NODE_READMITTED, node=rec.node, agent=rec.agent_id)
        self.job.poke()

    def _adopt(self, rec: NodeRecord, msg: m.Join) -> None:
        """A member of the running round re-registered with a master restarted from the
        journal: still training that round, it is adopted as it is (no restart)."""
        job = self.job
        rec.last_seen, rec.disconnected_at = job.clock(), None
        rec.addr, rec.nproc, rec.replica_port = msg.addr, msg.nproc, msg.replica_port
        if job.recovery is not None:
            job.recovery.report(msg.master_lost_at)
        in_round = msg.round == rec.round
        if in_round and msg.round_state is NodeState.DONE:
            rec.state = NodeState.DONE
        log.warning(
            "agent re-registered with the restarted master agent=%s node=%s round=%d state=%s",
            rec.agent_id,
            rec.node,
            msg.round,
            msg.round_state,
        )
        # An agent not in the round any more reports its failure or waits: see wait_round.
        adopted = in_round and msg.round_state is not NodeState.WAITING
        job.settle(rec, "adopted" if adopted else "rejoined")
        job.poke()

    def wait_round(self, msg: m.WaitRound) -> asyncio.Future[m.Assignment]:
        rec = self._record_of(msg.agent_id)
        fut: asyncio.Future[m.Assignment] = asyncio.get_running_loop().create_future()
        if self.job.ended:
            fut.set_result(self.job.finished_assignment())
            return fut
        if rec.state is NodeState.EXCLUDED or rec.left_job:
            reason = f"node {rec.node} is excluded from this job"
            if rec.left_job:
                reason = f"Slurm took node {rec.node} out of this job while its agent was lost"
            fut.set_result(m.Assignment(status=m.NodeStatus.EXCLUDED, reason=reason))
            return fut
        if rec.state is NodeState.ACTIVE and rec.round > msg.after_round and rec.assignment:
            fut.set_result(rec.assignment)  # it asked again (e.g. after a reconnect)
            return fut
        if rec.state is NodeState.DONE and self.job.phase is Phase.RUNNING:
            pass  # finished its part: waits for the job's end (or a new round, see open_round)
        elif rec.state in (NodeState.ACTIVE, NodeState.DONE, NodeState.LOST):
            left = rec.state is NodeState.ACTIVE and rec.round == self.job.round
            rec.state = NodeState.WAITING  # it stopped its workers and re-joins
            rec.joined_at = self.job.clock()
            if left and self.job.phase is Phase.RUNNING:
                # Its workers stopped with nothing reported (it missed the round's start
                # while the master restarted): the round cannot go on without them.
                self.job.apply([d.OpenRound(Phase.RESTARTING, f"node {rec.node} left the round")])
        if rec.waiter is not None and not rec.waiter.done():
            rec.waiter.cancel()
        if rec.pending is not None:  # a network-check task handed out while it was busy
            fut.set_result(rec.pending)
            rec.pending = None
            return fut
        rec.waiter = fut
        self.job.count_wait(fut)
        self.job.poke()
        return fut

    def netcheck_report(self, msg: m.NetcheckReport) -> m.Ack:
        self._record_of(msg.agent_id)
        self.job.netcheck.report(msg.agent_id, msg)
        self.job.poke()
        return m.Ack()

    def clock(self, msg: m.ClockRequest) -> m.ClockReply:
        """An agent's health check compares its clock with this (:mod:`agent.health`)."""
        return m.ClockReply(time=time.time())

    def node_unhealthy(self, msg: m.NodeUnhealthy) -> m.Ack:
        """An agent's node failed a health check before joining: exclude it, drain it."""
        rec = self._record_of(msg.agent_id)
        rec.reason = f"unhealthy ({msg.check}): {msg.reason}"
        log.error(
            "node unhealthy node=%s check=%s reason=%s checks=%s",
            rec.node,
            msg.check,
            msg.reason,
            " ".join(msg.results),
        )
        self.job.emit(
            EventName.NODE_UNHEALTHY,
            node=rec.node,
            agent=rec.agent_id,
            check=msg.check,
            reason=msg.reason,
            checks=msg.results,
        )
        self.job.apply(
            d.node_unhealthy(rec.node, msg.check, msg.reason, drain=self.job.config.drain)
        )
        self.job.poke()
        return m.Ack()

    def heartbeat(self, msg: m.Heartbeat) -> m.HeartbeatReply:
        rec = self._record_of(msg.agent_id)
        rec.last_seen = self.job.clock()
        rec.disconnected_at, rec.link_timed_out = None, False
        if msg.round == self.job.round and rec.state is NodeState.ACTIVE:
            if self.hangs is not None:
                self.hangs.heartbeat(
                    rec.node,
                    msg.progress,
                    rtt_s=msg.rtt_s,
                    tcp_rtt_s=(msg.tcp_rtt_s, msg.tcp_min_rtt_s, msg.tcp_links),
                )
            self._progress(rec, msg.progress)
        return m.HeartbeatReply(
            round=self.job.round,
            finished=self.job.ended,
            member=rec.state not in (NodeState.WAITING, NodeState.BENCHED),
        )

    def _progress(
        self, rec: NodeRecord, progress: list[m.RankProgress], final: bool = False
    ) -> None:
        if self._world[0] != self.job.round:
            self._world = (self.job.round, sum(n.nproc for n in self.job.participants()))
        self.job.loops.tally.progress(rec.round, progress)
        self.steps.report(
            node=rec.node,
            round=rec.round,
            world_size=self._world[1],
            progress=progress,
            final=final,
        )

    def workers_started(self, msg: m.WorkersStarted) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        self.job.emit(
            EventName.WORKERS_STARTED,
            node=rec.node,
            node_rank=rec.rank,
            round=msg.round,
            pids=msg.pids,
            in_process=msg.in_process,
            restart_count=self.job.restart_count,
        )
        return m.Ack()

    def worker_failed(self, msg: m.WorkerFailed) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        self.job.emit(
            EventName.WORKER_FAILED,
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
        log.warning(
            "worker failed node=%s local_rank=%d exit=%s signal=%s kind=%s restarts=%d/%d",
            rec.node,
            msg.local_rank,
            msg.exit_code,
            msg.signal,
            msg.classification,
            self.job.restart_count,
            self.job.config.max_restarts,
        )
        tally = self.job.loops.tally
        tally.progress(msg.round, msg.progress)
        tally.failed(
            crash_loop.Failure(
                round=msg.round,
                node=rec.node,
                rank=msg.rank,
                classification=msg.classification,
                error=crash_loop.error_line(msg.reason),
                external=msg.rule in crash_loop.EXTERNAL_RULES,
            )
        )
        on_node = [n for n in self.job.nodes.values() if n.node == rec.node]
        self.job.apply(
            d.worker_failed(
                msg,
                node=rec.node,
                node_active=any(n.state is NodeState.ACTIVE for n in on_node),
                phase=self.job.phase,
                round=self.job.round,
                restart_count=self.job.restart_count,
                max_restarts=self.job.config.max_restarts,
                drain=self.job.config.drain,
                loop=self.job.loop_now(),
            )
        )
        return m.Ack()

    def workers_succeeded(self, msg: m.WorkersSucceeded) -> m.Ack:
        rec = self._record_of(msg.agent_id)
        if msg.round == self.job.round and rec.state in (NodeState.ACTIVE, NodeState.DONE):
            self._progress(rec, msg.progress, final=True)
            rec.state, rec.stopped = NodeState.DONE, msg.stopped
            rec.checkpoints = list(msg.checkpoints)
            log.info("workers succeeded node=%s rank=%d", rec.node, rec.rank)
            if self.job.phase in FORMING:
                # Its workers ended just as the round re-opened (a replacement joined at the
                # training's end): it re-joins, as open_round has every node that was done,
                # and is not left out of the new round because its wait came a moment later.
                rec.state, rec.joined_at = NodeState.WAITING, self.job.clock()
            self.job.apply(d.workers_succeeded(self.job.phase, self.job.participants()))
        return m.Ack()

    def checkpoint_part(self, msg: m.CheckpointPart) -> m.CheckpointCommit:
        commit = self.job.commits.part_durable(
            step=msg.step, ranks=msg.ranks, world_size=msg.world_size, path=msg.path
        )
        if commit:
            self.job.last_committed = max(self.job.last_committed, msg.step)
        if commit and self.hangs is not None:
            self.hangs.committed()  # a straggler's node may go now
        return m.CheckpointCommit(commit=commit)

    # -------------------------------------------------------------- timers
    def disconnected(self, agent_id: str, *, link_timed_out: bool = False) -> None:
        """The agent's connection ended; ``link_timed_out``: TCP gave up on a silent link."""
        rec = self.job.nodes.get(agent_id)
        if rec is not None and rec.state not in (NodeState.LOST, NodeState.EXCLUDED):
            rec.disconnected_at = self.job.clock()
            self._disconnected.add(agent_id)
            rec.link_timed_out = link_timed_out
            if link_timed_out:  # already silent for the link timeout: lost now, not at the tick
                silence_s = self.job.config.heartbeat_silence_s
                self.job.apply(
                    d.lost_agents([rec], now=rec.disconnected_at, heartbeat_timeout_s=silence_s)
                )
            self.job.poke()

    def check_liveness(self) -> None:
        """On the liveness tick: agents silent past the timeout, or disconnected past the
        grace, are lost (:func:`decisions.lost_agents`)."""
        job, now = self.job, self.job.clock()
        silence_s = job.config.heartbeat_silence_s
        every_s = 0.0 if len(job.nodes) <= EVERY_TICK_NODES else silence_s / SILENCE_PASSES
        if self._silence_pass_at is None or now - self._silence_pass_at >= every_s:
            self._silence_pass_at = now
            records = list(job.nodes.values())
            self._disconnected = {r.agent_id for r in records if r.disconnected_at is not None}
        else:
            records = [job.nodes[a] for a in self._disconnected if a in job.nodes]
        job.apply(
            d.lost_agents(
                records, now=now, heartbeat_timeout_s=silence_s, forming=job.phase in FORMING
            )
        )

    def check_capacity(self) -> None:
        """Replacements and requeue; only once this process completed a rendezvous."""
        if self.job.rounds_here == 0:
            return
        now = self.job.clock()
        self.job.capacity, actions = d.capacity(
            self.job.capacity,
            phase=self.job.phase,
            records=list(self.job.nodes.values()),
            excluded_nodes=self.job.excluded_nodes,
            params=self.job.params,
            now=self.job.clock(),
            min_nodes_timeout_s=self.job.config.min_nodes_timeout_s,
            can_replace=self.job.can_replace,
            can_requeue=self.job.can_requeue,
            relaunching=self.job.relaunches.in_flight(now),
            judging=self.job.relaunching_possible and self.job.relaunches.judging(now),
        )
        self.job.apply(actions)

    def say_waiting(self) -> None:
        """A line every :data:`WAITING_SAY_S` while a round waits for nodes: the job's output
        shows what it waits for instead of going quiet."""
        job, now = self.job, self.job.clock()
        if job.phase not in FORMING:
            self._waiting_since = None
            return
        if self._waiting_since is None:
            self._waiting_since = self._said_at = now
            return
        if now - self._said_at < WAITING_SAY_S:
            return
        self._said_at = now
        reachable = sum(1 for n in job.nodes.values() if d.reachable(n))
        nnodes = job.config.nnodes
        log.info(
            "waiting for nodes: %d reachable of %d-%d wanted, %.0f s in phase %s (round %d next)",
            reachable,
            nnodes.min,
            nnodes.max,
            now - self._waiting_since,
            job.phase.value,
            job.round + 1,
        )

    def replacement_failed(self, count: int, reason: str) -> None:
        """Slurm refused a replacement request for ``count`` nodes (on the loop's thread)."""
        alive = sum(1 for n in self.job.nodes.values() if n.state in d.USABLE)
        self.job.capacity, next_action = d.replacement_failed(
            self.job.capacity, alive=alive, params=self.job.params, now=self.job.clock()
        )
        log.warning("replacement refused count=%d reason=%s next=%s", count, reason, next_action)
        self.job.emit(EventName.REPLACEMENT_FAILED, count=count, reason=reason, next=next_action)
        self.job.poke()
