"""The agent watches its workers make progress and reads their stacks (issue 13).

A worker progresses when its progress record changes (an optimizer step, a flash-checkpoint
save, an explicit ``dlrover_hpc.progress.step``, a section opened or closed) or, between those,
when its Python stack changes; a worker inside a section (an evaluation, a checkpoint, a data
loader's start), or one that never reported a step (started without the zygote's hooks, no
torch optimizer), also progresses while it or its children (data-loader workers) use CPU.  Not
outside sections: a rank that waits for a GPU collective may spin on a core.  Stacks are read
only while a worker's steps stall (every ``sample_s``), with py-spy as the job's own user;
where the kernel forbids that (Yama ``ptrace_scope`` 2 or 3), the agent says so once and asks
the worker itself (faulthandler on SIGUSR2, set up by :mod:`dlrover_hpc.worker.hooks`).
A stopped process cannot answer that signal, so py-spy comes first.  Blocking: the agent
calls it from a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping

import psutil

from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.config import HANG_AUTO
from dlrover_hpc.diagnosis import stacks as st
from dlrover_hpc.jobdir import local_user
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.worker import membership, progress
from dlrover_hpc.worker.hooks import STACK_SIGNAL, stack_file

log = logging.getLogger(__name__)

PY_SPY_TIMEOUT_S = 10.0
BUSY_CPU = 0.02  # of one core: a worker with no step signal that uses this much is working
#: A worker *works* (computes without steps: an evaluation the script does not mark, a long
#: first step) while it and its children use at least this share of a core, read over at
#: least :data:`WORK_WINDOW_S`.  A rank blocked in a gloo collective, a receive, a lock or a
#: join uses next to nothing (under 0.01 here); one that computes on a node shared with a
#: test suite's other jobs got as little as 0.2.  Not on a GPU: a rank waiting for CUDA may
#: spin on a core.
WORKING_CPU, WORK_WINDOW_S = 0.1, 2.0
FAULTHANDLER_WAIT_S = 2.0
#: the least time kept workers get to leave a round in-process (see Watchdog.leave_wait_s)
LEAVE_WAIT_S = 5.0


def _base() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def progress_template(job_id: str, node: str, agent_pid: int | None = None) -> str:
    """Where each worker's progress record is, ``{}`` standing for its local rank: node-local
    (``/dev/shm``); names carry user, job, node and agent, so two jobs never collide and the
    records of a SIGKILLed agent can be told apart (:func:`sweep_stale`)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{local_user()}-{job_id}-{node}")
    pid = os.getpid() if agent_pid is None else agent_pid
    return os.path.join(_base(), f"dlrover-hpc-{safe}-a{pid}-{{}}.progress")


_RECORD_NAME = re.compile(
    r"^dlrover-hpc-.*-a(\d+)-\d+\.progress(\.stack|\.round|\.left|\.inprocess)?$"
)


def _alive(pid: int) -> bool:
    """The process runs (not gone, not a zombie left for its parent to reap)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def sweep_stale() -> list[str]:
    """Remove this user's progress records whose agent is gone (it was SIGKILLed)."""
    removed = []
    prefix = f"dlrover-hpc-{local_user()}-"
    for name in os.listdir(_base()):
        found = _RECORD_NAME.match(name) if name.startswith(prefix) else None
        if found is None or psutil.pid_exists(int(found.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_base(), name))
            removed.append(name)
    return removed


def _py_spy() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else shutil.which("py-spy")


class StackReader:
    """py-spy first, then the worker's own faulthandler; says once why py-spy cannot."""

    def __init__(self) -> None:
        self.py_spy = _py_spy()
        self._warned = False

    def read(self, pid: int, progress_file: str) -> tuple[st.Stack | None, str]:
        error = "py-spy is not installed"
        if self.py_spy is not None:
            try:
                out = subprocess.run(
                    [self.py_spy, "dump", "--pid", str(pid), "--json", "--nonblocking"],
                    capture_output=True,
                    text=True,
                    timeout=PY_SPY_TIMEOUT_S,
                )
                if out.returncode == 0:
                    return st.from_py_spy(json.loads(out.stdout)), ""
                error = (out.stderr.strip() or out.stdout.strip())[-300:] or "py-spy failed"
            except (subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as exc:
                error = f"py-spy: {exc}"
        if not self._warned:
            self._warned = True
            log.warning(
                "cannot read worker stacks with py-spy (%s); asking the workers (faulthandler "
                "on %s) instead, which a stopped process cannot answer",
                error,
                STACK_SIGNAL.name,
            )
        return self._faulthandler(pid, stack_file(progress_file), error)

    @staticmethod
    def _faulthandler(pid: int, path: str, why: str) -> tuple[st.Stack | None, str]:
        record = progress.read(path.removesuffix(".stack"))
        if record is None or record.pid != pid or not os.path.exists(path):
            # No handler: SIGUSR2 would end the process (a worker without the hooks).
            return None, f"{why}; the worker has no stack handler (started without hooks)"
        try:
            before = os.path.getsize(path)
            os.kill(pid, STACK_SIGNAL)
        except OSError as exc:
            return None, f"{why}; faulthandler: {exc}"
        deadline = time.monotonic() + FAULTHANDLER_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(before)
                text = f.read().decode(errors="replace")
                stack = st.from_faulthandler(text)
                if stack.threads and text.endswith("\n"):
                    return stack, ""
        return None, f"{why}; the process did not answer {STACK_SIGNAL.name}"


def _cpu_seconds(pid: int, *, own: bool = True) -> float | None:
    """CPU seconds (user and system) the process and its children used, or its children
    alone when not ``own``; None when the process is gone."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)] if own else proc.children(True)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    cpu = 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            times = p.cpu_times()
            cpu += times.user + times.system
    return cpu


def _maps_cuda(pid: int) -> bool:
    """The process has CUDA's driver library mapped (it uses a GPU)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libcuda.so" in f.read()
    except OSError:
        return False


def status_of(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"


@dataclasses.dataclass(slots=True)
class _Rank:
    rank: int
    pid: int  # torch's API started a zygote client: the record names the worker, once it ran
    path: str
    count: int = -1
    step: int = -1
    step_at: float = 0.0  # wall clock of that step (the record's time)
    forward_s: float = 0.0
    p99_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
    section: progress.Section | None = None
    stack_phase: progress.Section | None = None  # a long phase seen in its stack (no hook)
    changed_at: float = 0.0
    sampled_at: float = 0.0
    signature: tuple[st.Frame, ...] = ()
    cpu: tuple[float, float] = (0.0, 0.0)  # CPU seconds used, and when that was read
    child_cpu: tuple[float, float] = (0.0, 0.0)  # the same, of its children alone
    stopped_since: float = 0.0  # when it was first seen stopped, throughout since (0: not)
    stopped_switches: int = -1  # its main thread's context switches then
    stopped_told: bool = False  # a heartbeat went early for this stop (stopped_past)
    work_cpu: tuple[float, float] = (0.0, 0.0)  # CPU seconds (it and its children), read when
    working: bool = False  # it computed over the last window (see WORKING_CPU)
    cuda: bool = False  # it maps libcuda: CPU use is no evidence of work

    def seen(self, record: progress.Progress | None) -> None:
        if record is not None and record.pid > 0:
            self.pid = record.pid


def _saved_step(path: str) -> int:
    saved = progress.saved_at(path)
    return -1 if saved is None else saved


class Watchdog:
    def __init__(self, *, sample_s: float) -> None:
        self.sample_s = sample_s
        self.reader = StackReader()
        self._ranks: dict[int, _Rank] = {}

    def start_round(self, ranks: Mapping[int, tuple[int, int, str]]) -> None:
        """``local_rank -> (rank, pid, progress file)`` of the workers just started."""
        now = time.monotonic()
        self._ranks = {
            lr: _Rank(rank, pid, path, changed_at=now) for lr, (rank, pid, path) in ranks.items()
        }

    def request_stop(self, notice: progress.StopNotice) -> None:
        """Tells every worker of the round to persist its first save at or after the step
        and exit (time limit, preemption): a write into each progress record."""
        for r in self._ranks.values():
            try:
                progress.request_stop(r.path, notice)
            except OSError as exc:
                log.warning("stop notice not written rank=%d error=%s", r.rank, exc)

    def stopped(self) -> bool:
        """Whether a worker ended for the stop notice (not because training was over)."""
        return any(progress.stopped_at(r.path) is not None for r in self._ranks.values())

    def descendants(self) -> list[psutil.Process]:
        """The round's workers' children (data-loader workers, subprocesses), now."""
        procs: list[psutil.Process] = []
        for r in self._ranks.values():
            with contextlib.suppress(psutil.Error):
                procs += psutil.Process(r.pid).children(recursive=True)
        return procs

    def continue_stopped(self) -> None:
        """SIGCONT every worker of the round that is stopped, so that it can end."""
        for r in self._ranks.values():
            with contextlib.suppress(psutil.Error, OSError):
                if psutil.Process(r.pid).status() == psutil.STATUS_STOPPED:
                    os.kill(r.pid, signal.SIGCONT)

    def stop_round(self, *, kept: bool = False) -> None:
        """The round's workers are gone, or ``kept`` for the next round (in-process): their
        records stay, the workers write into them still."""
        for r in self._ranks.values():
            if kept:
                continue
            for path in (r.path, stack_file(r.path)):
                with contextlib.suppress(OSError):
                    os.unlink(path)
            membership.clear(r.path)
        self._ranks = {}

    def leave_wait_s(self) -> float:
        """How long kept workers may take to leave a round: they leave at their next
        collective, so a few of their step times (p99), at least LEAVE_WAIT_S."""
        p99 = [
            record.p99_s
            for r in self._ranks.values()
            if (record := progress.read(r.path)) is not None
        ]
        return max([LEAVE_WAIT_S, *(3 * p for p in p99)])

    def _statuses(self) -> Iterator[str | None]:
        """Each worker's process status, of its own pid (not a zygote client's); None: it
        is gone.  A process psutil cannot read is left out."""
        for r in self._ranks.values():
            r.seen(progress.read(r.path))
            try:
                yield psutil.Process(r.pid).status()
            except psutil.NoSuchProcess:
                yield None
            except psutil.Error:
                continue

    def any_worker_gone(self) -> bool:
        """A worker process of the round has exited (or is a zombie)."""
        return any(s in (None, psutil.STATUS_ZOMBIE) for s in self._statuses())

    def any_stopped_process(self) -> bool:
        """A worker stopped by a signal (SIGSTOP, a debugger): it cannot leave a round."""
        stopped = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        return any(s in stopped for s in self._statuses())

    def stopped_past(self, bound_s: float) -> bool:
        """A worker has just been stopped by a signal for ``bound_s``, throughout (the
        master's stopped-process bound): true once per such stop, so that its agent sends
        a heartbeat now rather than at the next interval.  Cheap while nothing is stopped:
        one status read per worker."""
        now, due = time.monotonic(), False
        for r in list(self._ranks.values()):
            if not r.stopped_since and status_of(r.pid) != psutil.STATUS_STOPPED:
                continue
            if self._stopped_for(r, now) >= bound_s and not r.stopped_told:
                r.stopped_told = due = True
        return due

    def poll(self) -> list[m.RankProgress]:
        """Each worker's step and how long since it last progressed."""
        now = time.monotonic()
        out = []
        for r in self._ranks.values():
            record = progress.read(r.path)
            r.seen(record)
            section = progress.read_section(r.path)
            if section is None and not _alive(r.pid):
                # It exited and the round goes on: it finished (a failure ends the round
                # within a monitor interval), and its peers are in their teardown
                section = r.section if r.section and r.section.name == "exit" else None
                section = section or progress.Section("exit", time.time())
            if section != r.section:
                r.section, r.changed_at = section, now  # a phase began or ended
            section = section or r.stack_phase
            if record is not None and record.count != r.count:
                r.count, r.step, r.changed_at = record.count, record.step, now
                r.step_at = record.time
                r.forward_s = record.forward_s or r.forward_s
                r.p99_s = record.p99_s
                r.compute_s, r.wait_s = record.compute_s, record.wait_s
                r.signature = ()  # stacks are compared among samples taken since
                r.stack_phase = None
            elif (section is not None or r.count <= 1) and self._busy(r, now):
                r.changed_at = now  # in a section, or never stepped: its CPU use is the signal
            stalled = now - r.changed_at >= self.sample_s
            if (stalled or r.stack_phase is not None) and now - r.sampled_at >= self.sample_s:
                r.sampled_at = now
                # Outside sections the rank's own CPU says nothing (a GPU collective may spin
                # on it), but its children's does: a data-loader worker, a compile worker, a
                # copy to storage run as a subprocess.
                if stalled and section is None and r.count > 1 and self._busy(r, now, own=False):
                    r.changed_at = now
                stack, _ = self.reader.read(r.pid, r.path)
                signature = stack.signature() if stack is not None else ()
                if signature and r.signature and signature != r.signature:
                    r.changed_at = now  # it moves: busy between steps, not stuck
                r.signature = signature or r.signature
                phase = st.phase_of(stack)
                if not phase:
                    r.stack_phase = None
                elif r.stack_phase is None or r.stack_phase.name != phase:
                    # torch.save, an evaluation loop: the section's bound, from now on
                    r.stack_phase, r.changed_at = progress.Section(phase, time.time()), now
                section = section or r.stack_phase
            stopped_s = self._stopped_for(r, now)
            self._read_work(r, now)
            timed = progress.timed_at(r.path)
            wall = time.time()
            out.append(
                m.RankProgress(
                    rank=r.rank,
                    step=r.step,
                    stalled_s=round(now - r.changed_at, 3),
                    forward_s=r.forward_s,
                    at=r.step_at,
                    p99_s=r.p99_s,
                    compute_s=r.compute_s,
                    wait_s=r.wait_s,
                    section=section.name if section else "",
                    # since the section began, or the rank's newest step in it
                    section_s=round(max(0.0, wall - max(section.since, r.step_at)), 3)
                    if section
                    else 0.0,
                    section_bound_s=section.bound_s if section else 0.0,
                    stopped_s=round(stopped_s, 3),
                    saved_step=_saved_step(r.path),
                    working=r.working and not stopped_s,
                    timed_steps=timed[0],
                    compute_total_s=timed[1],
                    wait_total_s=timed[2],
                )
            )
        return out

    @staticmethod
    def _read_work(r: _Rank, now: float) -> None:
        """Whether the worker computes (see :data:`WORKING_CPU`): read every
        :data:`WORK_WINDOW_S` at most, the verdict kept in between."""
        last_cpu, last_at = r.work_cpu
        if last_at and now - last_at < WORK_WINDOW_S:
            return
        cpu = _cpu_seconds(r.pid)
        if cpu is None:
            r.working, r.work_cpu = False, (0.0, 0.0)
            return
        r.cuda = r.cuda or _maps_cuda(r.pid)
        r.working = bool(last_at) and not r.cuda and cpu - last_cpu >= WORKING_CPU * (now - last_at)
        r.work_cpu = (cpu, now)

    @staticmethod
    def _stopped_for(r: _Rank, now: float) -> float:
        """How long the worker has been stopped by a signal (SIGSTOP, SIGTSTP; not a debugger's
        trace stop), without a break: its state is ``T`` now and was at the first sight, and
        its main thread has not run since (its context switches did not change; a process
        stopped and continued in turn, as behind a throttle, runs in between)."""
        try:
            proc = psutil.Process(r.pid)
            with proc.oneshot():
                stopped = proc.status() == psutil.STATUS_STOPPED
                switches = sum(proc.num_ctx_switches()) if stopped else -1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            stopped, switches = False, -1
        if not stopped:
            r.stopped_since, r.stopped_switches, r.stopped_told = 0.0, -1, False
            return 0.0
        if not r.stopped_since or switches != r.stopped_switches:
            r.stopped_since, r.stopped_switches, r.stopped_told = now, switches, False
        return now - r.stopped_since

    @staticmethod
    def _busy(r: _Rank, now: float, *, own: bool = True) -> bool:
        """It and its children (data-loader workers; only those when not ``own``) used more
        than :data:`BUSY_CPU` of a core since the last sample (a worker that waits in a
        collective or is stopped uses next to nothing)."""
        cpu = _cpu_seconds(r.pid, own=own)
        if cpu is None:
            return False
        last_cpu, last_at = r.cpu if own else r.child_cpu
        if own:
            r.cpu = (cpu, now)
        else:
            r.child_cpu = (cpu, now)
        return last_at > 0 and (cpu - last_cpu) >= BUSY_CPU * (now - last_at)

    def dump(self, node: str) -> list[m.RankStackRow]:
        """Every worker's stack now."""
        rows = []
        for r in self._ranks.values():
            r.seen(progress.read(r.path))
            pid = r.pid
            status = status_of(pid)
            stack, error = (
                (None, "the process is gone") if status == "gone" else self.reader.read(pid, r.path)
            )
            rows.append(
                m.RankStackRow(
                    rank=r.rank,
                    node=node,
                    pid=pid,
                    status=status,
                    step=r.step,
                    error=error,
                    stack=st.to_json(stack),
                )
            )
        return rows

    async def answer(self, link: MasterLink, agent_id: str, node: str, request_id: int) -> None:
        """The master's :class:`m.DumpStacks`: every worker's stack, sent back."""
        rows = await asyncio.to_thread(self.dump, node)
        msg = m.StacksDumped(agent_id=agent_id, request_id=request_id, ranks=rows)
        await link.request(msg, m.Ack, timeout_s=30)


#: With ``--hang-timeout auto`` stacks are compared this often while steps stall (the
#: shortest learned bound is 30 s).
AUTO_SAMPLE_S = 5.0


def default_sample_s(hang_timeout_s: float) -> float:
    """Stacks are compared this often while steps stall: a sixth of the hang timeout."""
    if hang_timeout_s in (HANG_AUTO, 0):  # 0: the master may still run auto (its own flag)
        return AUTO_SAMPLE_S
    return min(60.0, max(1.0, hang_timeout_s / 6))


def reap(procs: list[psutil.Process]) -> int:
    """SIGKILL those of ``procs`` still alive once their worker was stopped: a data-loader
    worker blocked in a read never notices that its rank is gone, and would outlive the job.
    Returns how many were killed."""
    killed = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():  # the same process (psutil checks its start time)
                proc.kill()
                killed += 1
    return killed
