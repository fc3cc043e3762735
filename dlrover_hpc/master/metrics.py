"""The master's running account of its job, and its Prometheus endpoint (``--metrics-port``).

:class:`Observer` reads the job's ``events.jsonl`` (from its start: a restarted master goes
on counting) into the same :class:`~dlrover_hpc.report.analysis.Analysis` that
``dlrover-hpc report`` uses, so the goodput a dashboard shows is the report's.
:class:`JobCollector` turns that and the job's live state into metrics at each scrape; nothing
is computed between scrapes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import CollectorRegistry

from dlrover_hpc.errors import UsageError
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.report.analysis import Analysis
from dlrover_hpc.report.model import Report

log = logging.getLogger(__name__)

#: histogram bounds of checkpoint seconds: a blocking save is milliseconds, a persist minutes
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)
PREFIX = "dlrover_hpc_"


class Observer:
    """Reads the job's ``events.jsonl`` as it grows (the master's own events and those the
    training processes and savers append) into one running :class:`Analysis`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.analysis = Analysis()
        self._lock = threading.Lock()
        self._offset = 0
        self._partial = b""
        self._warned = False
        self._round_step = -1  # newest step saved or restored since the last rendezvous

    def _catch_up(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
                self.analysis.add(record)
                self._track_step(record)
            except (ValueError, KeyError, TypeError) as exc:
                if not self._warned:  # a damaged line: skip it, say so once
                    log.warning("goodput: skipped a bad line of %s (%s)", self.path, exc)
                    self._warned = True

    def _track_step(self, record: dict[str, object]) -> None:
        event, step = record.get("event"), record.get("step")
        if event == "rendezvous_complete":
            self._round_step = -1
        elif event in ("checkpoint_saved", "checkpoint_restored") and isinstance(step, int):
            self._round_step = max(self._round_step, step)

    def round_step(self) -> int:
        """The newest step a rank saved or restored in the running round (-1: none yet):
        a rank's own word, fresher than the heartbeats' progress."""
        with self._lock:
            self._catch_up()
            return self._round_step

    def report(self) -> Report | None:
        """Goodput so far (no lanes); None before the job started."""
        with self._lock:
            self._catch_up()
            try:
                return self.analysis.report(now=time.time(), lanes=False)
            except UsageError:
                return None

    def checkpoint_seconds(self) -> dict[str, list[float]]:
        with self._lock:
            self._catch_up()
            a = self.analysis
            return {
                "save": [v for r in a.rounds for v in r.blocking.values()],
                "persist": list(a.persist_s),
                "restore": list(a.restore_s),
            }


def _histogram(name: str, doc: str, values: Sequence[float]) -> HistogramMetricFamily:
    buckets = [(f"{b:g}", float(sum(1 for v in values if v <= b))) for b in BUCKETS]
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=sum(values))


class JobCollector:
    def __init__(self, job: Job, observer: Observer, steps: StepLog) -> None:
        self.job, self.observer, self.steps = job, observer, steps

    def collect(self) -> Iterator[Metric]:
        job, p = self.job, PREFIX
        nodes = list(job.nodes.values())  # one C-level copy: the loop thread may add nodes
        by_state = GaugeMetricFamily(
            p + "nodes", "Nodes the master knows, by state", labels=["state"]
        )
        counts = Counter(n.state for n in nodes)
        for state in NodeState:
            by_state.add_metric([state.value], counts.get(state, 0))
        yield by_state
        phase = GaugeMetricFamily(
            p + "phase", "The job's phase (1 for the current one)", labels=["phase"]
        )
        for ph in Phase:
            phase.add_metric([ph.value], 1.0 if job.phase is ph else 0.0)
        yield phase
        yield GaugeMetricFamily(p + "round", "The rendezvous round", value=job.round)
        yield CounterMetricFamily(
            p + "restarts", "Worker restarts charged to --max-restarts", value=job.restart_count
        )
        yield GaugeMetricFamily(
            p + "max_restarts", "The job's --max-restarts", value=job.config.max_restarts
        )
        report = self.observer.report()
        failures = CounterMetricFamily(
            p + "worker_failures", "Worker failures by classification", labels=["classification"]
        )
        for kind, count in sorted((report.failures if report else {}).items()):
            failures.add_metric([kind], count)
        yield failures
        yield GaugeMetricFamily(
            p + "step",
            "The job's newest step (its slowest rank's)",
            value=max(self.steps.step, 0),
        )
        yield GaugeMetricFamily(
            p + "step_rate",
            "Steps per second, between the two newest reports",
            value=self.steps.step_rate(),
        )
        if report is not None and report.last_checkpoint_step is not None:
            committed = self.observer.analysis.committed
            yield GaugeMetricFamily(
                p + "checkpoint_step",
                "The newest committed checkpoint's step",
                value=report.last_checkpoint_step,
            )
            yield GaugeMetricFamily(
                p + "checkpoint_age_seconds",
                "Seconds since the newest checkpoint was committed",
                value=max(
                    0.0, time.time() - committed.get(report.last_checkpoint_step, time.time())
                ),
            )
        seconds = self.observer.checkpoint_seconds()
        yield _histogram(
            p + "checkpoint_save_seconds",
            "Training blocked per save (slowest rank)",
            seconds["save"],
        )
        yield _histogram(
            p + "checkpoint_persist_seconds", "Seconds to persist a node's part", seconds["persist"]
        )
        yield _histogram(
            p + "checkpoint_restore_seconds", "Seconds a rank took to restore", seconds["restore"]
        )
        if report is not None and report.ideal_step_s > 0:  # known after a few step reports
            yield GaugeMetricFamily(
                p + "goodput",
                "Goodput so far: useful steps x median step time / wall",
                value=report.goodput,
            )
            yield GaugeMetricFamily(
                p + "wall_seconds", "Seconds since the job started", value=report.wall_s
            )


def serve(collector: JobCollector, *, host: str, port: int) -> Callable[[], None]:
    """Serve ``/metrics`` from a thread; returns the function that stops it."""
    from prometheus_client import start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
