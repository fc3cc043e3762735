"""The per-node agent: join, run workers, supervise them, re-rendezvous on any change."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from pathlib import Path

from dlrover_hpc import environ, injections, jobdir
from dlrover_hpc.agent import health, promotion, requeue_memory, tcp_links
from dlrover_hpc.agent import watchdog as wd
from dlrover_hpc.agent.decisions import Next, Outcome, on_assignment, round_outcome, round_over
from dlrover_hpc.agent.diagnose import Diagnoser
from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.agent.node_lock import hold_node_lock
from dlrover_hpc.agent.probe import run_probe
from dlrover_hpc.agent.reports import report_failure
from dlrover_hpc.agent.saver_link import local_tier_env, start_replica_server, start_saver
from dlrover_hpc.agent.workers import WorkerFailure, WorkerGroup
from dlrover_hpc.agent.zygote import Zygote
from dlrover_hpc.checkpoint.saver.host import SaverHost
from dlrover_hpc.checkpoint.saver.replicas import ReplicaServer
from dlrover_hpc.config import RequeueBy, RunConfig
from dlrover_hpc.diagnosis import stacks as st
from dlrover_hpc.diagnosis.classify import Diagnosis
from dlrover_hpc.diagnosis.rules import FailureKind
from dlrover_hpc.jobdir import local_user
from dlrover_hpc.master.hang_bounds import STOPPED_BOUND_S
from dlrover_hpc.master.thread import MasterThread
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient
from dlrover_hpc.slurm.env import parse_slurm_env
from dlrover_hpc.worker import membership
from dlrover_hpc.worker.progress import PATH_ENV, StopNotice

log = logging.getLogger(__name__)

#: How often the agent looks for a worker stopped by a signal (:meth:`Agent._stopped_watch`).
STOPPED_CHECK_S = 0.25

#: How long the first workers wait for the pre-warmed interpreter (its `import torch`) before
#: they start as fresh interpreters instead.
ZYGOTE_WAIT_S = 30.0
#: At a successful end, how long the node's last persists may take (a large checkpoint on a
#: slow file system) before it reports to the master what is on storage.
END_PERSIST_TIMEOUT_S = 600.0
#: How long a round change waits for the exit of a worker seen gone to reach torch's API.
LATE_FAILURE_WAIT_S = 2.0


def new_zygote() -> Zygote:
    return Zygote(f"/tmp/dlrover-hpc-{local_user()}-agent{os.getpid()}-zygote.sock")


def zygote_env(config: RunConfig) -> dict[str, str]:
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and config.nproc_per_node > 1:
        env["OMP_NUM_THREADS"] = "1"  # as the workers get it (read at import)
    return env


def prewarmed(config: RunConfig) -> bool:
    """Whether workers fork from a pre-warmed interpreter (not with --no-python or
    --no-prewarm)."""
    return not config.no_python and injections.PREWARM.name not in config.off


def start_zygote(config: RunConfig) -> Zygote | None:
    """The node's pre-warmed interpreter, started first thing: forked from this process while
    it has one thread, when it imported torch already (``--standalone``: the master it hosts
    needs torch), before a master thread or the event loop's workers start; else a new
    interpreter that imports torch in the background."""
    if not prewarmed(config):
        return None
    zygote = new_zygote()
    zygote.start(zygote_env(config), fork=True)
    return zygote


class Agent:
    def __init__(
        self,
        config: RunConfig,
        *,
        master: tuple[str, int],
        token: str,
        job_dir: Path,
        extra_env: dict[str, str] | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        self.config = config
        self.master = master
        self._token = token
        self.job_dir = job_dir
        self.saver: SaverHost | None = None
        self.replica_server: ReplicaServer | None = None
        self._job_id = ""
        self._extra_env = extra_env or {}
        self.node = socket.gethostname().split(".")[0]
        # Per-rank logs default to the job directory; stderr is teed there (and still shown)
        # so a failure's log tail can be diagnosed.
        log_dir = config.log_dir or str(job_dir / "logs" / self.node)
        self.zygote = zygote or (new_zygote() if prewarmed(config) else None)
        self.workers = WorkerGroup(config, log_dir=log_dir, zygote=self.zygote)
        self.diagnoser = Diagnoser()
        self.watchdog = wd.Watchdog(sample_s=wd.default_sample_s(config.hang_timeout_s))
        self._tcp = tcp_links.TcpLinks()
        self._tasks: set[asyncio.Task[None]] = set()
        self.link: MasterLink | None = None
        self._lock_fd = -1  # held (close-on-exec) until this process exits
        self._master_epoch = 0  # of the master this agent knows (master.json's)
        self._round_state, self._node_rank = m.NodeState.WAITING, -1
        self.hosted_master: MasterThread | None = None  # promoted: this agent runs the master
        self.agent_id = ""
        self.round = 0
        self._stop = asyncio.Event()
        #: the master ended the job to continue it (time limit, preemption): StopAt
        self._continues = False
        #: its workers' last round ended with training done, not at the stop step: the master
        #: continues nothing then (stopping.conclude), so the local tier goes at the end
        self._trained_out = False
        self._round_changed = asyncio.Event()
        self._beat_now = asyncio.Event()  # a heartbeat now, not at the interval's end
        self._master_gone = False  # the link gave up reconnecting
        # The workers left the last round in-process and wait for the next (issue 26).
        self._kept = False
        self._joins_running_job = False  # not the job's first rendezvous (JoinReply)
        #: the master's link timeout when longer than ours (a large job's: JoinReply)
        self._link_timeout_s = config.link_timeout_s
        self._own_failure = False  # the last round's failure was its own workers' (health)
        self.health = health.NodeHealth(
            node=self.node,
            program=config.health_check,
            program_timeout_s=config.health_check_timeout_s,
            expected_gpus=health.expected_gpus(os.environ),
        )

    # -------------------------------------------------------------- setup
    async def _open_link(self) -> None:
        async def connect(pushes: asyncio.Queue[m.Message]) -> MasterClient:
            # A restarted or promoted master may listen elsewhere: master.json says where.
            self.master, self._master_epoch = await asyncio.to_thread(
                promotion.where_master, self.job_dir, self.master, self._master_epoch
            )
            try:
                return await MasterClient.connect(
                    *self.master,
                    token=self._token,
                    link_timeout_s=self._link_timeout_s,
                    pushes=pushes,
                )
            except OSError:  # a stale address (a replacement job's): ask master.json
                found = await asyncio.to_thread(
                    promotion.where_master, self.job_dir, self.master, -1
                )
                if found[0] == self.master:
                    raise
                self.master, self._master_epoch = found
                return await connect(pushes)

        self.link = MasterLink(
            connect, self._register, reconnect_timeout_s=self.config.reconnect_timeout_s
        )
        await self.link.open()

    async def _register(self, client: MasterClient) -> None:
        """Join, or re-join under the same agent id after a reconnect."""
        slurm = parse_slurm_env(os.environ)
        reply = await client.request(
            m.Join(
                node=self.node,
                addr=self.config.local_addr or self.node,
                nproc=self.config.nproc_per_node,
                slurm_node_id=slurm.node_id if slurm else None,
                topology_addr=slurm.topology_addr if slurm else None,
                agent_id=self.agent_id or None,
                network_check=self.config.network_check,
                exclude_straggler=self.config.exclude_straggler,
                hang_timeout_s=self.config.hang_timeout_s,
                straggler_factor=self.config.straggler_factor,
                launch_argv=list(self.config.launch_argv),
                launch_cwd=os.getcwd(),
                round=self.round,
                round_state=self._round_state,
                master_lost_at=self.link.lost_at if self.link else 0.0,
                replica_port=self.replica_server.address[1] if self.replica_server else 0,
            ),
            m.JoinReply,
            timeout_s=30,
        )
        rejoined = bool(self.agent_id)
        self.agent_id = reply.agent_id
        self._job_id = reply.job_id
        self._heartbeat_s = reply.heartbeat_interval_s
        self._joins_running_job = reply.job_running
        if reply.link_timeout_s > self._link_timeout_s:
            self._link_timeout_s = reply.link_timeout_s
            client.set_link_timeout(reply.link_timeout_s)
        log.info(
            "%s master=%s:%d agent=%s",
            "re-joined" if rejoined else "joined",
            *self.master,
            self.agent_id,
        )

    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGUSR1, self._on_requeue_signal)

    def _on_requeue_signal(self) -> None:
        """Slurm's USR1 (``--signal=USR1@T``) reaches every process of the step; the agent's
        part is not to die of it (Python's default)."""
        if self.config.requeue_by is RequeueBy.FRAMEWORK:
            log.info("SIGUSR1: the workers' framework requeues the job (--requeue-by=framework)")
        else:
            log.info(
                "SIGUSR1: the job master saves and continues the job; the workers do not see "
                "it (--requeue-by=dlrover-hpc)"
            )

    # --------------------------------------------------------------- loop
    async def run(self) -> int:
        self._install_signals()
        if self.zygote is not None and not self.zygote.started:
            self.zygote.start(zygote_env(self.config))  # imports torch while the rendezvous runs
        self._lock_fd = hold_node_lock(self.job_dir, self.node)
        await asyncio.to_thread(wd.sweep_stale)  # progress records of a SIGKILLed agent
        # segments kept for a requeue that went elsewhere or never ran
        await asyncio.to_thread(requeue_memory.sweep_stale, os.environ)
        if self.config.local_ckpt_dir:  # local tiers of this user's jobs that Slurm forgot
            await asyncio.to_thread(
                requeue_memory.sweep_stale_tiers, os.environ, self.config.local_ckpt_dir
            )
        self.replica_server = replicas = start_replica_server(self._token, self.node)
        await self._open_link()
        assert self.link is not None
        beats = asyncio.create_task(self._heartbeats())
        stops = asyncio.create_task(self._stopped_watch())
        pushes = asyncio.create_task(self._pushes())
        promote = asyncio.create_task(self._watch_master())
        self.saver = start_saver(
            self.link,
            job_id=self._job_id,
            node=self.node,
            token=self._token,
            replicas=replicas,
            events_path=str(jobdir.events_path(self.job_dir)),
            local_dir=self.config.local_ckpt_dir,
        )
        try:
            return await self._rounds()
        finally:
            await self._stop_workers()
            # Finish in-flight persists (they need the master), then remove the segments,
            # unless Slurm requeued the job: its next run restores from them on this node.
            keep = self._stop.is_set() and await asyncio.to_thread(
                requeue_memory.keep_for_requeue,
                os.environ,
                segments=bool(self.saver.segments()) or self.saver.has_local_tier(),
            )
            # The local tier also outlives a stop to continue the job (time limit, preemption:
            # the master requeues it after the agents ended); sweep_stale_tiers takes it later
            # when the continuation is a new job instead.
            await asyncio.to_thread(
                self.saver.close,
                not keep,
                remove_local_tier=not (keep or (self._continues and not self._trained_out)),
            )
            await asyncio.to_thread(replicas.close)
            beats.cancel()
            stops.cancel()
            pushes.cancel()
            promote.cancel()
            await self.link.close()
            if self.zygote is not None:
                await asyncio.to_thread(self.zygote.stop)
            if self.hosted_master is not None:  # it serves the other agents to the job's end
                if self._stop.is_set() and not self._master_gone:
                    self.hosted_master.stop("SIGTERM")
                await asyncio.to_thread(self.hosted_master.join, 24 * 3600)

    async def _rounds(self) -> int:
        assert self.link is not None
        if await self._unhealthy():
            return 1  # excluded: never starts workers
        if self.zygote is not None and not self.config.no_python and self._joins_running_job:
            # Waiting for a round is what admits this node: a node that joins a running job
            # (a spare, a replacement, a relaunch) is taken in only once it can start its
            # workers at once, or the kept survivors would wait for its interpreter's warm-up.
            # Not at the job's start: a node that waited would miss the first round.
            deadline = time.monotonic() + ZYGOTE_WAIT_S
            while self.zygote.alive and not self._stop.is_set() and time.monotonic() < deadline:
                try:
                    if await asyncio.to_thread(self.zygote.ready, 0.25):
                        break
                except (OSError, ValueError):
                    break  # it stopped: the workers start as fresh interpreters
        while True:
            wait = asyncio.create_task(
                self.link.request(
                    m.WaitRound(agent_id=self.agent_id, after_round=self.round),
                    m.Assignment,
                    timeout_s=24 * 3600,
                )
            )
            stop = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait({wait, stop}, return_when=asyncio.FIRST_COMPLETED)
            if stop in done:
                wait.cancel()
                if self._master_gone:
                    return 1
                log.info("agent stopped by signal while waiting in rendezvous")
                return 143
            stop.cancel()
            try:
                assignment = wait.result()
            except ConnectionError as exc:  # the link gave up: no master to wait for
                log.error("lost the master error=%s", exc)
                return 1
            step = on_assignment(assignment)
            if step.next is Next.EXIT:
                if assignment.status is m.NodeStatus.EXCLUDED:
                    log.error("this node is excluded from the job: %s", assignment.reason)
                else:
                    log.info(
                        "job finished exit_code=%d reason=%s", step.exit_code, assignment.reason
                    )
                return step.exit_code
            if step.next is Next.PROBE:
                await run_probe(self.link, self.agent_id, assignment, self.zygote)
                continue
            outcome = await self._run_round(assignment)
            if outcome is Outcome.STOPPED:
                return 1 if self._master_gone else 143
            if self._own_failure and await self._unhealthy():
                return 1  # its workers failed and the node is unhealthy now: excluded

    async def _unhealthy(self) -> bool:
        """The node's health check before it joins (:mod:`health`); True: it failed, and the
        master was told.  A stop signal ends a long site program (then False: the wait for a
        round sees the signal)."""
        assert self.link is not None
        check = asyncio.create_task(health.gate(self.health, self.link, self.agent_id, self.saver))
        stop = asyncio.create_task(self._stop.wait())
        await asyncio.wait({check, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if not check.done():
            check.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await check
            return False
        return check.result() is not None

    async def _run_round(self, a: m.Assignment) -> Outcome:
        assert self.link is not None
        self._own_failure = False
        self.round, self._node_rank = a.round, a.node_rank
        self._round_changed.clear()
        progress_file = wd.progress_template(self._job_id, self.node)  # worker_env: + local rank
        env = {
            **environ.WorkerEnv(
                master=f"{self.master[0]}:{self.master[1]}",
                job_dir=str(self.job_dir),
                job_id=self._job_id,
                node_name=self.node,
                progress_file=progress_file,
                # Module forward hooks cost a few percent of a small step: only on request.
                forward_timing=os.environ.get(environ.FORWARD_TIMING) == "1",
                saver_socket=self.saver.socket_path if self.saver else None,
            ).to_environ(),
            **local_tier_env(self.config.local_ckpt_dir),
            **self._extra_env,
        }
        self.diagnoser.workers_starting()
        if self.saver is not None:
            peers = {int(k): v for k, v in a.replica_peer_map.items()}
            peers = peers or dict(enumerate(a.replica_peers))  # an older master's list
            self.saver.set_replica_peers(a.node_rank, a.nnodes, peers)
        if self.zygote is not None and not self.config.no_python:
            # One `import torch` on the node, not one more per worker: the pre-warmed
            # interpreter started with the agent and imports while the rendezvous runs; when it
            # is not done yet, wait for it (bounded) rather than start every worker afresh.
            with contextlib.suppress(OSError, ValueError):  # it stopped meanwhile
                await asyncio.to_thread(self.zygote.ready, ZYGOTE_WAIT_S)
        kept, self._kept = self._kept, False
        if kept and self.workers.running and self.workers.poll() is None:
            pids = self.workers.rejoin(a, env)  # the same processes, in the new round
        else:
            if kept:
                log.info("a kept worker ended meanwhile: starting new workers")
                await self._stop_workers()
            kept = False
            pids = self.workers.start(a, env)
        self.watchdog.start_round(
            {lr: (a.rank_offset + lr, pid, progress_file.format(lr)) for lr, pid in pids.items()}
        )
        self._round_state = m.NodeState.ACTIVE
        # torch's process context installs its own SIGTERM/SIGINT handlers (they raise inside
        # whatever runs); ours only set an event that the monitor loop acts on.
        self._install_signals()
        await self.link.request(
            m.WorkersStarted(
                agent_id=self.agent_id, round=a.round, pids=list(pids.values()), in_process=kept
            ),
            m.Ack,
            timeout_s=30,
        )
        outcome, failures = await self._monitor(a, env)
        self._round_state = (
            m.NodeState.DONE if outcome is Outcome.SUCCEEDED else m.NodeState.WAITING
        )
        if outcome is Outcome.SUCCEEDED:
            self.workers.stop()
            final = await asyncio.to_thread(self.watchdog.poll)  # each rank's last step
            stopped = self.watchdog.stopped()
            self._trained_out = not stopped
            self.watchdog.stop_round()
            checkpoints = await asyncio.to_thread(self._persist_for_the_end)
            await self.link.request(
                m.WorkersSucceeded(
                    agent_id=self.agent_id,
                    round=a.round,
                    progress=final,
                    stopped=stopped,
                    checkpoints=checkpoints,
                ),
                m.Ack,
                timeout_s=30,
            )
            return outcome
        if outcome is Outcome.ROUND_CHANGED and (late := await self._failed_as_round_changed()):
            outcome, failures = Outcome.FAILED, late
        if outcome is Outcome.ROUND_CHANGED:
            if await self._leave_in_process(env):
                return outcome
            await self._stop_workers()
            await self._report_logged_hardware_fault(a)
            return outcome
        if outcome is Outcome.FAILED:
            first = failures[0]
            diagnosis = self.diagnoser.diagnose(first)
            kind = diagnosis.kind.value
            # not a lost peer's symptom: the node checks itself again before it re-joins
            self._own_failure = diagnosis.kind is not FailureKind.PEER
            log.warning(
                "worker failed rank=%d exit_code=%s signal=%s classification=%s",
                first.rank,
                first.exit_code,
                first.signal,
                kind,
            )
            await report_failure(
                self.link,
                self.agent_id,
                a,
                first.local_rank,
                diagnosis,
                exit_code=first.exit_code,
                signal=first.signal,
                progress=await asyncio.to_thread(self.watchdog.poll),  # the steps reached
            )
        await self._stop_workers()
        return outcome

    async def _failed_as_round_changed(self) -> list[WorkerFailure]:
        """A worker of this node that died just as the round changed, which its death may
        have caused (kept peers report their lost collectives at once): its exit reaches
        the process context a moment later (a zygote client mirrors it), and the master
        must still hear of the cause, not only of its peers' symptoms."""
        deadline = time.monotonic() + LATE_FAILURE_WAIT_S
        while True:
            result = await asyncio.to_thread(self.workers.poll)
            if result is not None:
                return self.workers.failures(result) if result.is_failed() else []
            if time.monotonic() > deadline or not self.watchdog.any_worker_gone():
                return []
            await asyncio.sleep(0.05)

    async def _report_broken(self, a: m.Assignment, env: dict[str, str]) -> bool:
        """A kept worker's collective lost a peer (:func:`membership.broken`): report it as
        a peer-lost failure, so that the round re-forms without waiting for the lost node's
        own report or its reconnect grace.  True once reported."""
        for lr in range(self.config.nproc_per_node):
            found = membership.broken(env[PATH_ENV].format(lr))
            if found is not None and found[0] == a.round:
                diagnosis = Diagnosis(
                    kind=FailureKind.PEER,
                    rule="peer_lost_in_process",
                    reason="a worker that changes rounds in-process lost a peer",
                    evidence=(found[1],),
                )
                await report_failure(self.link, self.agent_id, a, lr, diagnosis)
                return True
        return False

    async def _leave_in_process(self, env: dict[str, str]) -> bool:
        """Workers under the in-process wrapper leave the round and stay for the next one
        (:mod:`dlrover_hpc.worker.membership`); False: end them as usual (not all of them opted in,
        one is stopped by a signal, or one did not leave in time)."""
        if not self.workers.kept_in_process(env) or self.watchdog.any_stopped_process():
            return False
        leave = membership.Notice(self.round + 1, membership.LEAVE)
        records = [env[PATH_ENV].format(lr) for lr in range(self.config.nproc_per_node)]
        for record in records:
            membership.tell(record, leave)
        deadline = time.monotonic() + self.watchdog.leave_wait_s()
        while time.monotonic() < deadline:
            if all(membership.left(r) >= leave.round for r in records):
                self.watchdog.stop_round(kept=True)
                self._kept = True
                log.info("workers left round=%d in-process; they wait for the next", self.round)
                return True
            if self.workers.poll() is not None:  # one ended instead
                break
            await asyncio.sleep(0.005)  # the round forms once every survivor has left
        late = [r for r in records if membership.left(r) < leave.round]
        log.warning(
            "workers did not leave round=%d in-process: ending them; %s",
            self.round,
            await asyncio.to_thread(self._where_stuck, late),
        )
        return False

    def _where_stuck(self, records: list[str]) -> str:
        """Where each worker that did not leave stands (py-spy): what a user needs to see
        why the round change cost a restart after all."""
        rows = [r for r in self.watchdog.dump(self.node) if r.status != "gone"]
        lines = []
        for row in rows:
            stack = st.from_json(row.stack)
            frames = stack.main_thread() if stack else None
            body = (
                " <- ".join(f.short() for f in frames.frames[:8])
                if frames is not None
                else f"stack unreadable: {row.error}"
            )
            lines.append(f"rank {row.rank} pid {row.pid} ({row.status}) at step {row.step}: {body}")
        return "; ".join(lines) or f"{len(records)} record(s) not acknowledged"

    async def _report_logged_hardware_fault(self, a: m.Assignment) -> None:
        assert self.link is not None
        tails = {lr: self.workers.log_tail(lr) for lr in self.workers.stderr_paths}
        found = self.diagnoser.scan_logs(tails)
        if found is None:
            return
        local_rank, diagnosis = found
        log.warning("hardware fault in the log of local_rank=%d: %s", local_rank, diagnosis.reason)
        await report_failure(self.link, self.agent_id, a, local_rank, diagnosis)

    async def _monitor(
        self, a: m.Assignment, env: dict[str, str]
    ) -> tuple[Outcome, list[WorkerFailure]]:
        interval = self.config.monitor_interval_s
        reported = False
        while True:
            if not reported and (reported := await self._report_broken(a, env)):
                log.info("a kept worker lost a peer in round=%d: reported", a.round)
            stopped, changed = self._stop.is_set(), self._round_changed.is_set()
            result = None if stopped else await asyncio.to_thread(self.workers.poll)
            outcome = round_outcome(
                stopped=stopped,
                round_changed=changed,
                exited=result is not None,
                failed=result is not None and result.is_failed(),
            )
            if outcome is Outcome.ROUND_CHANGED:
                log.info("round changed: stopping workers to re-rendezvous")
            if outcome is Outcome.FAILED:
                assert result is not None
                return outcome, self.workers.failures(result)
            if outcome is not None:
                return outcome, []
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._round_changed.wait()

    async def _stop_workers(self) -> None:
        # A stopped (SIGSTOP) worker cannot act on SIGTERM: without a SIGCONT the node would
        # wait out the whole --shutdown-timeout and miss the next round (a hang's restart).
        leftovers = await asyncio.to_thread(self.watchdog.descendants)
        self.watchdog.continue_stopped()
        self.watchdog.stop_round()
        if self.workers.running:
            await asyncio.to_thread(self.workers.stop)
        if killed := await asyncio.to_thread(wd.reap, leftovers):
            log.warning("killed %d leftover processes of the stopped workers", killed)
        # Persist the newest in-memory checkpoint before anything restarts.
        if self.saver is not None:
            step = await asyncio.to_thread(self.saver.persist_latest, 120.0)
            if step is not None:
                log.info("persisted the newest in-memory checkpoint step=%d", step)

    def _persist_for_the_end(self) -> list[m.Durability]:
        """The workers succeeded: persist the newest in-memory step, finish every queued
        persist (the commits need the master, which waits for this node), then read what is
        on storage, so the master can tell a job whose newest step is not durable."""
        if self.saver is None:
            return []
        self.saver.persist_latest(END_PERSIST_TIMEOUT_S)
        if not self.saver.wait_idle(END_PERSIST_TIMEOUT_S):
            log.warning("persists still running after %.0f s at the end", END_PERSIST_TIMEOUT_S)
        found = [m.Durability(**dataclasses.asdict(d)) for d in self.saver.durability()]
        for d in found:
            if d.durable < d.wanted:
                log.error(
                    "checkpoint step %d is not on storage: the newest committed in %s is step "
                    "%d (%s)",
                    d.wanted,
                    d.ckpt_dir,
                    d.durable,
                    d.error or "its persist did not finish",
                )
        return found

    # ---------------------------------------------------- background tasks
    async def _pushes(self) -> None:
        assert self.link is not None
        while True:
            msg = await self.link.pushes.get()
            if isinstance(msg, m.RoundChanged) and msg.round > self.round:
                log.info("master opened round=%d reason=%s", msg.round, msg.reason)
                self._round_changed.set()
            elif isinstance(msg, m.StopAt):
                log.warning("stop at step=%d: %s", msg.step, msg.reason)
                self._continues = True
                self.watchdog.request_stop(StopNotice(msg.step, msg.deadline))
            elif isinstance(msg, m.PersistStep) and self.saver is not None:
                log.info("persist at step=%d: %s", msg.step, msg.reason)
                arm = asyncio.create_task(self._persist_step(msg.step))
                self._tasks.add(arm)
                arm.add_done_callback(self._tasks.discard)
            elif isinstance(msg, m.EndWorkers):
                if local := self.workers.end(msg.ranks):
                    log.warning("ending workers local_ranks=%s: %s", local, msg.reason)
            elif isinstance(msg, m.DumpStacks):
                answer = self.watchdog.answer(self.link, self.agent_id, self.node, msg.request_id)
                task = asyncio.create_task(answer)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _persist_step(self, step: int) -> None:
        """--persist-every: this node's ranks persist their first save at or after ``step``."""
        assert self.saver is not None
        try:
            await asyncio.to_thread(self.saver.persist_step, step)
        except Exception:  # a task's boundary: the job trains on, the master asks again
            log.exception("persist at step=%d failed", step)

    async def _watch_master(self) -> None:
        """Take over as master when the master's node died (:mod:`promotion`)."""
        assert self.link is not None
        slurm = parse_slurm_env(os.environ)
        self.hosted_master = await promotion.watch(
            self.link,
            job_dir=self.job_dir,
            token=self._token,
            epoch=lambda: self._master_epoch,
            wait_s=lambda: promotion.promote_after(
                self._node_rank, slurm.node_id if slurm else None
            ),
        )

    async def _stopped_watch(self) -> None:
        """A worker stopped by a signal (SIGSTOP) for the master's bound, throughout, is said
        in a heartbeat at once: the master's verdict then waits for no interval (2 s by
        default; soak seeds 1-3 found such hangs 2.2-4.4 s after the stop)."""
        while True:
            await asyncio.sleep(STOPPED_CHECK_S)
            running = self.workers.running and self._round_state is m.NodeState.ACTIVE
            early = running and self._heartbeat_s > STOPPED_CHECK_S
            if early and self.watchdog.stopped_past(STOPPED_BOUND_S):
                self._beat_now.set()

    async def _heartbeats(self) -> None:
        assert self.link is not None
        rtt_s = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self._heartbeat_s)
            self._beat_now.clear()
            running = self.workers.running and self._round_state is m.NodeState.ACTIVE
            polled_round = self.round
            progress = await asyncio.to_thread(self.watchdog.poll) if running else []
            links = tcp_links.Links()
            if running:  # the node's TCP round trips: a slow link that is alive (tcp_links)
                links = await asyncio.to_thread(self._tcp.read)
            if self.round != polled_round:
                # A new round began while the poll ran: what it read is the ended round's
                # workers (a stopped one among them), not the new round's.
                progress = []
            # The round trip of the previous heartbeat: the master compares nodes' to find a
            # slow link (a node whose every packet queues behind a throttled or lossy link).
            beat = m.Heartbeat(
                agent_id=self.agent_id,
                round=self.round,
                progress=progress,
                rtt_s=rtt_s,
                tcp_rtt_s=links.rtt_s,
                tcp_links=links.count,
                tcp_min_rtt_s=links.min_rtt_s,
            )
            sent = time.monotonic()
            try:
                reply = await self.link.request(
                    beat, m.HeartbeatReply, timeout_s=max(5.0, 2 * self._heartbeat_s)
                )
            except TimeoutError as exc:  # reconnecting, or a busy master: the link decides
                log.warning("heartbeat unanswered error=%s", exc)
                rtt_s = 0.0
                continue
            except ConnectionError as exc:
                log.error("lost the master error=%s; stopping workers", exc)
                self._master_gone = True
                self._stop.set()
                return
            rtt_s = round(time.monotonic() - sent, 6)
            if round_over(reply, my_round=self.round, workers_running=self.workers.running):
                self._round_changed.set()
