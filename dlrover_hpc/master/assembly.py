"""One assembly of the job master, whichever process hosts it.

``dlrover-hpc master``, ``dlrover-run --standalone``, an embedded master (a torchrun-style
``--rdzv-endpoint`` job), an agent promoted to master and the SSH launcher all call
:func:`build_master`: it claims the fail-over epoch, seals the logs, builds the :class:`Job`
with its callbacks, and the parts that answer the agents.  :class:`Master` then publishes the
master once it listens (:meth:`Master.listening`: the lease, ``master.json``, the metrics, the
cluster's parts).  The transport (:class:`dlrover_hpc.master.server.MasterServer`) only serves:
sockets, authentication, message dispatch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlrover_hpc import jobdir
from dlrover_hpc.config import MasterConfig, RequeueBy
from dlrover_hpc.events import EventName
from dlrover_hpc.master import failover, metrics, stopping
from dlrover_hpc.master.auto_persist import AutoPersist
from dlrover_hpc.master.cluster import Cluster, Site
from dlrover_hpc.master.continuation import StopKind
from dlrover_hpc.master.datasets import Datasets
from dlrover_hpc.master.decisions import Relaunch
from dlrover_hpc.master.handlers import AgentHandlers
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.journal import EventLog, Journal, TornLine, seal_torn_line
from dlrover_hpc.master.node_states import NodeStateWatch
from dlrover_hpc.master.policy import NodeRemover
from dlrover_hpc.master.relaunch import Relauncher
from dlrover_hpc.master.replace import Replacer
from dlrover_hpc.master.stores import TorchStores
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)

#: Where the master sends a message to one agent (the transport's writer for it).
Push = Callable[[str, m.Message], None]


def _nowhere(agent_id: str, message: m.Message) -> None:
    """Pushes before a transport serves the master go nowhere (no agent is connected)."""


def build_master(
    config: MasterConfig,
    cluster: Cluster,
    *,
    job_dir: Path,
    stores: Any = None,
    epoch: int | None = None,
) -> Master:
    """The master of ``config``'s job on ``cluster``, not yet listening.

    ``epoch``: claimed by the caller (a promoted agent); None: claim the next one here, once no
    other master renews the job's lease (raises :class:`failover.MasterServing`)."""
    # Before the journal is read: the master that wrote it must be gone.
    claimed = failover.take_over(job_dir) if epoch is None else epoch
    # Lines cut mid-write by the previous master's end: sealed before anything appends.
    torn = [seal_torn_line(path(job_dir)) for path in (jobdir.journal_path, jobdir.events_path)]
    master = Master(
        config,
        cluster,
        job_dir=job_dir,
        stores=stores or TorchStores(),
        epoch=claimed,
    )
    for t in torn:
        if t is not None:
            _report_torn(t, master.events)
    return master


def _report_torn(t: TornLine, events: EventLog) -> None:
    log.warning(
        "torn last line sealed file=%s line=%d bytes=%d text=%s: skipped when read",
        t.path,
        t.line,
        t.nbytes,
        t.text,
    )
    events.emit(EventName.LOG_REPAIRED, file=t.path.name, line=t.line, bytes=t.nbytes, text=t.text)


def _load_topology(path: str | None) -> Any:
    if not path:
        return None
    from dlrover_hpc import topology as topo

    return topo.load(path)


def _both(first: Callable[[], None] | None, watch: NodeStateWatch) -> Callable[[], None]:
    """A re-opening round's hooks: the straggler swap's, then the drained nodes'."""

    def opening() -> None:
        if first is not None:
            first()
        watch.round_opening()

    return opening


class Master:
    """The job master's parts, wired together (build it with :func:`build_master`)."""

    def __init__(
        self, config: MasterConfig, cluster: Cluster, *, job_dir: Path, stores: Any, epoch: int
    ) -> None:
        self.config = config
        self.cluster = cluster
        self.job_dir = job_dir
        self.epoch = epoch
        self.superseded = False  # a newer master claimed the job: this one stepped down
        self.sender: Push = _nowhere  # set by the transport that serves this master
        self.events = EventLog(jobdir.events_path(job_dir))
        self.observer = metrics.Observer(self.events.path)  # goodput so far, from the log
        self.advertised_host = socket.gethostname().split(".")[0]
        self.job = Job(
            config,
            stores=stores,
            store_host=self.advertised_host,
            push=self.push,
            topology=_load_topology(config.topology),
            events=self.events,
            journal=Journal(jobdir.journal_path(job_dir)),
            remove_node=self._remove_node,
            request_replacement=self._replacer_request,
            requeue=self._in_thread(self._replacer_requeue) if config.requeue else None,
            relaunch=self._relaunch,
        )
        self.replacer: Replacer | None = None
        self.relauncher: Relauncher | None = None
        site = Site(config=config, job_dir=job_dir, events=self.events)
        self._site = site
        self._remover: NodeRemover = cluster.remover(site)
        self._stop_metrics: Callable[[], None] | None = None
        self.hangs = HangWatch(self.job, self.push, job_dir)
        self.datasets = Datasets(job_dir)  # dlrover_hpc.data's shards, replayed from the file
        self.agents = AgentHandlers(self.job, self.hangs)
        #: Slurm's state of the job's nodes, watched while it runs (None outside Slurm)
        self.node_states: NodeStateWatch | None = None
        read_states = cluster.node_states(site)
        if read_states is not None:
            self.node_states = NodeStateWatch(self.job, self.push, read_states)
            self.job.on_round_opening = _both(self.job.on_round_opening, self.node_states)
        self.stopper = stopping.GracefulStop(
            self.job,
            self.agents.steps,
            self.push,
            lead_s=config.stop_lead_s,
            rank_step=self.observer.round_step,
        )
        #: --persist-every: every node persists the same step held in memory, this often
        self.auto_persist = AutoPersist(self.job, self.agents.steps, self.push, config)

    def push(self, agent_id: str, message: m.Message) -> None:
        self.sender(agent_id, message)

    def requests(self) -> dict[type[m.Message], Callable[[Any], Any]]:
        """What answers each request the master serves."""
        return {
            m.Join: self.agents.join,
            m.WaitRound: self.agents.wait_round,
            m.Heartbeat: self.agents.heartbeat,
            m.WorkersStarted: self.agents.workers_started,
            m.WorkerFailed: self.agents.worker_failed,
            m.WorkersSucceeded: self.agents.workers_succeeded,
            m.CheckpointPart: self.agents.checkpoint_part,
            m.StatusRequest: self._status,
            m.Event: self._event,
            m.NetcheckReport: self.agents.netcheck_report,
            m.ClockRequest: self.agents.clock,
            m.NodeUnhealthy: self.agents.node_unhealthy,
            m.StacksDumped: self.hangs.stacks_dumped,
            m.StacksRequest: self.hangs.stacks_request,
            m.StopRequest: self._stop_request,
            m.ShardRequest: lambda msg: self.datasets.request(msg, current_round=self.job.round),
        }

    # ------------------------------------------------------------ published
    def listening(self, port: int) -> None:
        """The master listens on ``port``: serve metrics, renew the lease, publish
        ``master.json`` and make the cluster's parts (which start agents that connect here)."""
        config = self.config
        if config.metrics_port:
            collector = metrics.JobCollector(self.job, self.observer, self.agents.steps)
            try:
                self._stop_metrics = metrics.serve(
                    collector, host=config.host, port=config.metrics_port
                )
            except OSError as exc:  # a promoted master's node may have the port taken
                log.error("no metrics: port %d (%s)", config.metrics_port, exc)
        info = {
            "host": self.advertised_host,
            "port": port,
            "pid": os.getpid(),
            "job_id": config.job_id,
            "embedded": config.embedded,
            "epoch": self.epoch,
            "metrics_port": config.metrics_port if self._stop_metrics else None,
        }
        jobdir.write_lease(self.job_dir, self.epoch)
        failover.save_config(self.job_dir, config)
        jobdir.write_master_info(self.job_dir, info)
        address = f"{self.advertised_host}:{port}"
        self.replacer = self.cluster.replacer(self._site, address)
        launcher = self.cluster.launcher(self._site, address)
        self.relauncher = Relauncher(self.job, launcher) if launcher is not None else None
        continuer = self.cluster.continuer(self._site)
        if continuer is not None and config.requeue_by is RequeueBy.FRAMEWORK:
            log.info("continuation left to the workers' framework (--requeue-by=framework)")
        elif continuer is not None:
            self.stopper.continuer = continuer

    def renew_lease(self) -> bool:
        """Renew the lease; False (and step down) when a newer master claimed the job."""
        if failover.superseded(self.job_dir, self.epoch):
            log.error("master epoch=%d superseded by a newer master; stepping down", self.epoch)
            self.superseded = True
            return False
        jobdir.write_lease(self.job_dir, self.epoch)
        return True

    def stop_metrics(self) -> None:
        if self._stop_metrics is not None:
            self._stop_metrics()
            self._stop_metrics = None

    # ------------------------------------------------------------ callbacks
    def _in_thread(self, fn: Callable[..., None]) -> Callable[..., None]:
        """Cluster commands must not stall the event loop."""

        def call(*args: Any) -> None:
            asyncio.get_running_loop().run_in_executor(None, fn, *args)

        return call

    def _replacer_request(self, count: int, exclude: list[str]) -> None:
        """sbatch in a thread; a refusal comes back to the job on the loop's thread."""
        replacer = self.replacer
        if replacer is None:
            return
        done = asyncio.get_running_loop().run_in_executor(None, replacer.request, count, exclude)

        def refused(fut: asyncio.Future[str | None]) -> None:
            reason = None if fut.cancelled() else fut.result()
            if reason:
                self.agents.replacement_failed(count, reason)

        done.add_done_callback(refused)

    def _replacer_requeue(self, reason: str) -> None:
        if self.replacer is not None:
            self.replacer.requeue(reason)

    def _relaunch(self, action: Relaunch) -> None:
        if self.relauncher is not None:
            self.relauncher.relaunch(action)

    def _remove_node(self, node: str, reason: str) -> None:
        """Drain or quarantine in a thread: scontrol must not stall the event loop."""
        asyncio.get_running_loop().run_in_executor(None, self._remover.remove, node, reason)

    # ------------------------------------------------------------- requests
    async def _status(self, msg: m.StatusRequest) -> m.StatusReply:
        reply = self.agents.status(msg)
        report = await asyncio.to_thread(self.observer.report)  # reads the log: not on the loop
        if report is None:
            return reply
        step = report.last_checkpoint_step
        committed = self.observer.analysis.committed.get(step, 0.0) if step is not None else 0.0
        return dataclasses.replace(
            reply,
            goodput=report.goodput if report.ideal_step_s > 0 else -1.0,
            checkpoint_step=-1 if step is None else step,
            checkpoint_age_s=round(time.time() - committed, 1) if committed else -1.0,
        )

    def _stop_request(self, msg: m.StopRequest) -> m.Ack:
        try:
            kind = StopKind(msg.kind) if msg.kind else None
        except ValueError:
            raise ValueError(f"stop kind {msg.kind!r}: expected time_limit or preempted") from None
        self.stopper.request(kind, msg.reason or "requested")
        return m.Ack()

    def _event(self, msg: m.Event) -> m.Ack:
        self.events.emit(msg.event, **msg.fields)
        if msg.event == EventName.CHECKPOINT_PERSISTED:
            self.auto_persist.persisted(msg.fields)
        return m.Ack()
