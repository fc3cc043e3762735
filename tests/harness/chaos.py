"""A seeded stream of faults against a job on the local Slurm, and what the job made of it.

Used by ``benchmarks/soak.py`` (10 minutes, a fault every ~50 s) and by a short chaos test in
the suite.  :func:`plan` is pure (a seed gives the same faults), :class:`Chaos` injects them
on a :class:`LocalSlurm`, and :func:`analyze` (pure) turns the job's ``events.jsonl`` and the
rank-0 timing log (``time step restart`` per line) into goodput, stalls, lost steps and
restores by source.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import glob
import itertools
import os
import random
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from dlrover_hpc.localslurm.local_slurm import LocalSlurm
from dlrover_hpc.worker import progress

AGENT_MARKS = ("dlrover-run", "dlrover_hpc.cli.run")
#: processes whose command line names dlrover-run without being one: srun of the agents' step
#: (killing it ends every agent of the step), the batch script, slurmstepd
NOT_AGENTS = ("srun", "bash", "sh", "slurmstepd", "timeout")


class FaultKind(enum.StrEnum):
    WORKER_KILL = "worker_kill"  # SIGKILL one training process
    AGENT_KILL = "agent_kill"  # SIGKILL dlrover-run (its workers die with it)
    SLURMD_KILL = "slurmd_kill"  # SIGKILL slurmd; started again after heal_s
    LINK_CUT = "link_cut"  # the node's control link down for heal_s
    NODE_CRASH = "node_crash"  # every process of the node, marked down; back after heal_s
    DRAIN = "drain"  # an admin drains a node; resumed after heal_s
    # Faults that do not crash anything (issue 25):
    WORKER_HANG = "worker_hang"  # SIGSTOP one training process, never continued
    SLOW_NODE = "slow_node"  # the node's first training process runs 1/4 of the time, heal_s
    LINK_SLOW = "link_slow"  # the node's link rate-limited (tbf; no netem here), for heal_s


#: Seconds until the node is healed, per kind (0: nothing to heal).
HEAL_S = {
    FaultKind.WORKER_KILL: 0.0,
    FaultKind.AGENT_KILL: 0.0,
    FaultKind.SLURMD_KILL: 10.0,
    FaultKind.LINK_CUT: 30.0,
    FaultKind.NODE_CRASH: 20.0,
    FaultKind.DRAIN: 60.0,
    FaultKind.WORKER_HANG: 0.0,
    FaultKind.SLOW_NODE: 120.0,
    FaultKind.LINK_SLOW: 120.0,
}
#: A slow node's worker runs ``SLOW_ON_S`` of every ``SLOW_PERIOD_S`` (SIGCONT, then SIGSTOP):
#: whatever it does, a step that needs the CPU waits for its next turn, as behind a throttled
#: CPU (a cgroup quota would not slow the sleeps a toy step is made of).
SLOW_PERIOD_S, SLOW_ON_S = 0.4, 0.1
#: A slow link's rate: the gloo traffic of a toy DDP job fills it, so every packet queues.
LINK_SLOW_RATE = "256kbit"
PROCESS_LEVEL = frozenset(
    {FaultKind.WORKER_KILL, FaultKind.AGENT_KILL, FaultKind.WORKER_HANG, FaultKind.SLOW_NODE}
)


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds after the stream starts
    kind: FaultKind
    pick: int  # which of the eligible nodes (modulo their number)


def plan(
    seed: int, *, duration_s: float, every_s: float, kinds: Sequence[FaultKind] = tuple(FaultKind)
) -> list[Fault]:
    """Faults every ``every_s`` +-20 %, kinds in a shuffled cycle so each one occurs."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    cycle: list[FaultKind] = []
    t = 0.0
    while True:
        t += every_s * rng.uniform(0.8, 1.2)
        if t > duration_s:
            return faults
        if not cycle:
            cycle = list(kinds)
            rng.shuffle(cycle)
        faults.append(Fault(round(t, 1), cycle.pop(), rng.randrange(1 << 16)))


def agents_on(cluster: LocalSlurm, node: str) -> list[psutil.Process]:
    """dlrover-run processes in the node's namespace (not their workers or zygote)."""
    found = []
    for pid in cluster.netns_pids(node):
        try:
            proc = psutil.Process(pid)
            cmd = " ".join(proc.cmdline())
            name = proc.name()
            parent = proc.parent()
            pcmd = " ".join(parent.cmdline()) if parent else ""
        except psutil.Error:
            continue
        if name in NOT_AGENTS or not any(k in cmd for k in AGENT_MARKS):
            continue
        if not any(k in pcmd for k in AGENT_MARKS):
            found.append(proc)
    return found


def _scontrol(*args: str) -> None:
    subprocess.run(["scontrol", "update", *args], capture_output=True, timeout=30, check=False)


@dataclasses.dataclass(slots=True)
class Chaos:
    """Injects faults on the job's nodes; never on ``spared`` (the master's node: the master
    has no stand-by yet, issue 14)."""

    cluster: LocalSlurm
    spared: frozenset[str]
    heal_s: dict[FaultKind, float] = dataclasses.field(default_factory=dict)  # over HEAL_S
    job_id: str = ""  # finds the training processes (hang, slow node) by their progress records
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    _heals: list[tuple[float, FaultKind, str]] = dataclasses.field(default_factory=list)
    _stopped: list[int] = dataclasses.field(default_factory=list)
    _throttles: dict[str, threading.Event] = dataclasses.field(default_factory=dict)

    def inject(self, fault: Fault, training: Sequence[str], workers: dict[str, list[int]]) -> None:
        """``training``: the nodes of the job's newest round; ``workers``: node -> pids."""
        node_level = fault.kind not in PROCESS_LEVEL
        busy = {n for _, _, n in self._heals}
        nodes = [n for n in training if not (node_level and n in self.spared) and n not in busy]
        if not nodes:
            self.log.append({"time": time.time(), "kind": fault.kind, "node": None})
            return
        node = nodes[fault.pick % len(nodes)]
        match fault.kind:
            case FaultKind.WORKER_KILL:
                pids = workers.get(node, [])
                for pid in pids[:1]:
                    _kill(pid)
            case FaultKind.AGENT_KILL:
                for proc in agents_on(self.cluster, node):
                    _kill(proc.pid)
            case FaultKind.SLURMD_KILL:
                self.cluster.kill_slurmd(node)
            case FaultKind.LINK_CUT:
                self.cluster.cut_link(node)
            case FaultKind.NODE_CRASH:
                self.cluster.kill_node(node)
            case FaultKind.DRAIN:
                _scontrol(f"nodename={node}", "state=drain", "reason=chaos: admin drain")
            case FaultKind.WORKER_HANG | FaultKind.SLOW_NODE:
                pids = training_pids(self.cluster, self.job_id, node)[:1]
                if not pids:  # between two rounds: nothing to hit
                    self.log.append({"time": time.time(), "kind": fault.kind, "node": None})
                    return
                if fault.kind is FaultKind.WORKER_HANG:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pids[0], signal.SIGSTOP)
                        self._stopped.append(pids[0])
                else:
                    stop = threading.Event()
                    self._throttles[node] = stop

                    def find(node: str = node) -> int | None:
                        return next(iter(training_pids(self.cluster, self.job_id, node)), None)

                    args = (pids[0], find, stop)
                    threading.Thread(target=throttle, args=args, daemon=True).start()
            case FaultKind.LINK_SLOW:
                self.cluster.slow_link(node, rate=LINK_SLOW_RATE)
        self.log.append({"time": time.time(), "kind": fault.kind.value, "node": node})
        heal_s = self.heal_s.get(fault.kind, HEAL_S[fault.kind])
        if heal_s:
            self._heals.append((time.time() + heal_s, fault.kind, node))

    def heal_due(self, *, all_now: bool = False) -> None:
        now = time.time()
        for item in [h for h in self._heals if all_now or h[0] <= now]:
            self._heals.remove(item)
            _, kind, node = item
            if kind is FaultKind.LINK_CUT:
                self.cluster.heal_link(node)
            elif kind in (FaultKind.SLURMD_KILL, FaultKind.NODE_CRASH):
                self.cluster.restart_node(node)
            elif kind is FaultKind.DRAIN:
                _scontrol(f"nodename={node}", "state=resume")
            elif kind is FaultKind.SLOW_NODE and node in self._throttles:
                self._throttles.pop(node).set()
            elif kind is FaultKind.LINK_SLOW:
                self.cluster.unslow_link(node)

    def cleanup(self) -> None:
        """After the job: a hung worker the job never restarted would outlive it."""
        for pid in self._stopped:
            _kill(pid)
        self._stopped.clear()


def training_pids(cluster: LocalSlurm, job_id: str, node: str) -> list[int]:
    """The node's training processes (forked by the zygote: not the pids torch's API knows),
    from their progress records in the node's /dev/shm (its own mount namespace: seen through
    one of its processes), local rank 0 first."""
    for pid in cluster.netns_pids(node):
        shm = f"/proc/{pid}/root/dev/shm"
        paths = sorted(glob.glob(f"{shm}/dlrover-hpc-*-{job_id}-{node}-a*-*.progress"))
        found = []
        for path in paths:
            record = progress.read(path)
            if record is not None and record.pid > 0 and psutil.pid_exists(record.pid):
                found.append(record.pid)
        if found:
            return found
    return []


def throttle(
    pid: int | None,
    find: Callable[[], int | None],
    stop: threading.Event,
    *,
    on_s: float = SLOW_ON_S,
    period_s: float = SLOW_PERIOD_S,
) -> None:
    """Runs ``pid`` ``on_s`` of every ``period_s`` until ``stop``.  The node is what is slow,
    not the process: when it ends (the job restarted its workers), the node's next training
    process (``find``) is throttled in its place, if the node trains again."""
    while not stop.is_set():
        if pid is None and (pid := find()) is None:
            stop.wait(period_s)  # no training process there (between rounds, benched)
            continue
        try:
            os.kill(pid, signal.SIGCONT)
            time.sleep(on_s)
            os.kill(pid, signal.SIGSTOP)
        except OSError:  # it ended
            pid = None
            continue
        stop.wait(period_s - on_s)
    if pid is not None:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------ analysis
@dataclasses.dataclass(frozen=True, slots=True)
class Report:
    goodput: float
    wall_s: float
    ideal_step_s: float
    steps: int
    stalls: list[dict[str, Any]]  # start, seconds, cause (the fault before), events if long
    lost_steps: int  # steps redone beyond the newest checkpoint held when the fault hit
    redone_steps: int  # every step trained twice (since the restored checkpoint)
    restores: dict[str, int]  # source -> ranks restored from it
    restarts: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: a stall this long lists the job's events during it (a failed check's report says why)
LONG_STALL_S = 20.0
#: the events of a stall's list: not the ones every step or save writes
_ROUTINE = frozenset({"checkpoint_saved", "checkpoint_persisted", "training_progress"})


def _during(events: Sequence[dict[str, Any]], begin: float, end: float, start: float) -> list[str]:
    """``"+seconds event node"`` of the job's events from ``begin`` to ``end`` (at most 20)."""
    said = [
        f"+{e['time'] - start:.1f} {e['event']} {e.get('node') or ''}".rstrip()
        for e in events
        if begin <= e["time"] <= end and e["event"] not in _ROUTINE
    ]
    return said if len(said) <= 20 else [*said[:19], f"... {len(said) - 19} more"]


def analyze(
    events: Sequence[dict[str, Any]],
    timing: Sequence[tuple[float, int]],
    faults: Sequence[dict[str, Any]] = (),
    *,
    stall_factor: float = 5.0,
) -> Report:
    """Goodput = distinct steps trained x ideal step time / wall.  The ideal step time is the
    median interval between consecutive steps (rank 0's ``timing``: time, step); the wall runs
    from the job's start to its end.  A stall is a gap between two steps longer than
    ``stall_factor`` ideal steps, or a restart; its cause is the newest fault before it."""
    start = next(e["time"] for e in events if e["event"] == "job_started")
    end = next((e["time"] for e in events if e["event"] == "job_finished"), timing[-1][0])
    pairs = list(itertools.pairwise(timing))
    gaps = [b[0] - a[0] for a, b in pairs if b[1] == a[1] + 1]
    ideal = statistics.median(gaps) if gaps else 0.0
    saved = sorted((e["time"], e["step"]) for e in events if e["event"] == "checkpoint_saved")
    first = timing[0][0] if timing else end
    stalls = [{"start": 0.0, "seconds": round(first - start, 1), "cause": "start-up"}]
    redone = lost = restarts = 0
    for a, b in pairs:
        restarted = b[1] <= a[1]
        if restarted or b[0] - a[0] > stall_factor * ideal:
            before = [f for f in faults if f["time"] <= b[0]]
            cause = f"{before[-1]['kind']} {before[-1]['node']}" if before else "unknown"
            seconds = round(b[0] - a[0], 1)
            stall = {"start": round(a[0] - start, 1), "seconds": seconds, "cause": cause}
            if b[0] - a[0] >= LONG_STALL_S:  # what the job did meanwhile: why it took so long
                stall["events"] = _during(events, a[0], b[0], start)
            stalls.append(stall)
        if restarted:  # the workers resumed from step b[1] - 1
            restarts += 1
            redone += a[1] - (b[1] - 1)
            newest = max((s for t, s in saved if t <= a[0]), default=0)
            lost += max(0, newest - (b[1] - 1))
    # A restart that resumed from the very next step (a save just before the fault) does not
    # show in the timing; the master's workers_restarted events count every one.
    restarts = max(restarts, sum(1 for e in events if e["event"] == "workers_restarted"))
    steps = max((s for _, s in timing), default=0)
    restores: dict[str, int] = {}
    for e in events:
        if e["event"] == "checkpoint_restored":
            restores[e["source"]] = restores.get(e["source"], 0) + 1
    wall = end - start
    return Report(
        goodput=round(steps * ideal / wall, 3) if wall > 0 else 0.0,
        wall_s=round(wall, 1),
        ideal_step_s=round(ideal, 4),
        steps=steps,
        stalls=stalls,
        lost_steps=lost,
        redone_steps=redone,
        restores=restores,
        restarts=restarts,
    )
