"""The storage fault matrix: one job on the local Slurm checkpoints to a real network file
system (:mod:`harness.fileserver`) while its server stalls, fills, goes read-only, dies or
loses its link, one fault after the other; and what the job made of each.

Used by ``tests/runtime/test_storage_faults.py`` (asserts) and ``benchmarks/storage_faults.py``
(prints the figures).  :func:`run_matrix` runs the job and injects the faults;
:func:`analyze` (pure) turns the rank-0 timing log, the durability polls and the job's events
into a :class:`FaultOutcome` per fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from runtime_helpers import TRAIN, events, jsonl_records, named, sbatch, timing_log, wait_job

from dlrover_hpc.localslurm import wait_for
from harness.fileserver import FileServer, FileServerError

FLASH = TRAIN.parent / "train_flash_ckpt.py"
STEP_TIME_S = 0.1
BALLAST_MIB = 16  # the checkpoint's size, about: the model is tiny
SAVE_EVERY, PERSIST_EVERY = 2, 4  # a DISK save every 4 steps (0.4 s), memory every 2
JOB_NODES = ("node1", "node2")


class StorageFault(enum.StrEnum):
    STALL = "stall"  # the server SIGSTOPped (hung: connections up, no answer)
    FULL = "full"  # the export's file system full
    READ_ONLY = "read_only"  # the export remounted read-only
    RESTART = "restart"  # the server SIGKILLed (connections reset), started again
    LINK_CUT = "link_cut"  # the server's link down (a black hole), then up


def _inject(fs: FileServer, kind: StorageFault) -> None:
    {
        StorageFault.STALL: fs.stop,
        StorageFault.FULL: fs.fill,
        StorageFault.READ_ONLY: fs.read_only,
        StorageFault.RESTART: fs.kill,
        StorageFault.LINK_CUT: fs.cut_link,
    }[kind]()


def _heal(fs: FileServer, kind: StorageFault) -> None:
    {
        StorageFault.STALL: fs.cont,
        StorageFault.FULL: fs.free,
        StorageFault.READ_ONLY: fs.read_write,
        StorageFault.RESTART: fs.restart,
        StorageFault.LINK_CUT: fs.heal_link,
    }[kind]()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """One fault as injected: from ``begin`` to ``end`` (wall time), when the nodes' mounts
    answered again (a network file system's client can take longer than the fault: sshfs over
    a link that came back once hung 130 s on a loaded machine), when training was at
    ``step_at_end`` (the newest step once the mounts answered) and when that step became
    durable."""

    kind: StorageFault
    begin: float
    end: float
    answered_at: float  # when every job node's mount took a small write again, after ``end``
    step_at_end: int
    durable_at: float | None  # None: never within the wait


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FaultOutcome:
    kind: StorageFault
    held_s: float
    steps_lost: int  # steps trained again (a rollback) from the fault's start to the next's
    longest_gap_s: float  # between two consecutive steps, the fault and its recovery
    rate_ratio: float  # steps per second during the fault / in the same time before it
    durable_after_s: float | None  # mounts answer again -> the step trained then committed
    answered_after_s: float  # fault cleared -> every job node's mount answers again
    stalled_events: int  # persist_stalled events during the fault and its recovery
    #: mounts answer again -> the last persist stall the savers reported ended, before the
    #: step was durable (None: none ended after the mounts answered).  sshfs can strand a
    #: request in flight when its link died: new requests go through, the saver's persist
    #: thread waits on that one until it is answered or abandoned.
    stall_ended_after_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["kind"] = str(self.kind)
        for key in (
            "held_s",
            "longest_gap_s",
            "rate_ratio",
            "durable_after_s",
            "answered_after_s",
            "stall_ended_after_s",
        ):
            if out[key] is not None:
                out[key] = round(out[key], 2)
        return out


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MatrixRun:
    job: str
    state: str  # the Slurm job's end state
    output: str  # its slurm-JOB.out
    events: list[dict[str, Any]]
    timing: list[tuple[float, int]]  # (time, step) rank 0 trained
    windows: list[Window]
    export_step: int | None  # the newest step committed on the export at the end
    outcomes: list[FaultOutcome]

    @property
    def finished(self) -> dict[str, Any]:
        found = named(self.events, "job_finished")
        return found[-1] if found else {}

    @property
    def last_step(self) -> int:
        return self.timing[-1][1] if self.timing else -1


def newest_committed(ckpt: Path) -> int | None:
    """The step ``dlrover_latest.txt`` names on the export (read on the server's side)."""
    try:
        return int((ckpt / "dlrover_latest.txt").read_text().strip())
    except (OSError, ValueError):
        return None


def run_matrix(
    fs: FileServer,
    work: Path,
    kinds: Sequence[StorageFault],
    *,
    hold_s: Callable[[StorageFault], float],
    warmup_steps: int = 60,
    settle_s: float = 30.0,
    answer_s: float = 240.0,
    job_timeout_s: float = 300.0,
    refused_by: Collection[StorageFault] = (),
    refused_within_s: float = 30.0,
) -> MatrixRun:
    """One 2-node job (one rank per node) checkpointing into ``fs``'s mount; each of
    ``kinds`` in turn: injected, held ``hold_s(kind)`` seconds, cleared, waited on until every
    job node's mount takes a small write again (up to ``answer_s``), then until the step
    trained at that moment is committed on the export (up to ``settle_s``).  A fault in
    ``refused_by`` is held on past ``hold_s`` until the saver reported a persist it refused
    (``checkpoint_persist_failed``; at most ``refused_within_s`` more): a persist that began
    before the fault can take longer than the hold on two loaded cores."""
    ckpt_export = fs.export / "ckpt"
    ckpt_export.mkdir(exist_ok=True)
    until = work / "stop-training"
    job = sbatch(
        work,
        2,
        "--nnodes=2",
        "--nproc-per-node=1",
        str(FLASH),
        "--steps=100000",
        f"--until-file={until}",
        f"--step-time={STEP_TIME_S}",
        f"--save-every={SAVE_EVERY}",
        f"--persist-every={PERSIST_EVERY}",
        f"--ballast-mib={BALLAST_MIB}",
        f"--ckpt-dir={fs.mount_point / 'ckpt'}",
        f"--timing-log={work / 'timing.log'}",
        f"--result={work / 'result.json'}",
        extra=("-w", ",".join(JOB_NODES)),
    )
    windows: list[Window] = []
    polls: list[tuple[float, int | None]] = []
    stop_polling = threading.Event()

    def poll() -> None:  # the export's newest committed step, ten times a second
        while not stop_polling.wait(0.1):
            polls.append((time.time(), newest_committed(ckpt_export)))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        wait_for(
            lambda: _at_step(work, warmup_steps) and newest_committed(ckpt_export),
            timeout_s=180,
            what=f"job {job} to train {warmup_steps} steps and commit one",
            interval_s=0.3,
        )
        for kind in kinds:
            begin = time.time()
            _inject(fs, kind)
            try:
                time.sleep(hold_s(kind))
                if kind in refused_by:
                    _wait_refused(work / ".dlrover-hpc" / job, since=begin, s=refused_within_s)
            finally:
                _heal(fs, kind)
            end = time.time()
            answered = _answered(fs, JOB_NODES, answer_s)
            step = _trained(work)
            durable = _wait_durable(ckpt_export, step, settle_s)
            windows.append(
                Window(
                    kind=kind,
                    begin=begin,
                    end=end,
                    answered_at=answered,
                    step_at_end=step,
                    durable_at=durable,
                )
            )
            time.sleep(2.0)  # steps after it, before the next one begins
        until.write_text("stop")
        fields = wait_job(job, timeout_s=job_timeout_s)
    finally:
        until.write_text("stop")
        stop_polling.set()
        poller.join(timeout=5)
        subprocess.run(["scancel", job], capture_output=True, timeout=30, check=False)
    evs = events(work / ".dlrover-hpc" / job)
    timing = timing_log(work)
    out = (work / f"slurm-{job}.out").read_text() if (work / f"slurm-{job}.out").exists() else ""
    return MatrixRun(
        job=job,
        state=fields.get("JobState", "?"),
        output=out,
        events=evs,
        timing=timing,
        windows=windows,
        export_step=newest_committed(ckpt_export),
        outcomes=analyze(windows, timing, evs),
    )


def _wait_refused(job_dir: Path, *, since: float, s: float) -> None:
    """Until the job logged a ``checkpoint_persist_failed`` after ``since``, at most ``s``."""

    def refused() -> bool:  # jsonl_records skips the line being written
        failed = named(jsonl_records(job_dir, "events.jsonl"), "checkpoint_persist_failed")
        return any(e.get("time", 0) >= since for e in failed)

    with contextlib.suppress(TimeoutError):
        wait_for(refused, timeout_s=s, what="a refused persist", interval_s=0.2)


def _answered(fs: FileServer, nodes: Sequence[str], timeout_s: float) -> float:
    """When each of ``nodes``' mounts took a small write with fsync again (the client's own
    recovery, whatever the job's saver does): the latest of them.  Raises when one did not
    within ``timeout_s``: the file system, not the job, is then what failed."""
    done: dict[str, float] = {}
    errors: dict[str, str] = {}

    def probe(node: str) -> None:
        target = fs.mount_point / f".answers-{node}"
        argv = ["dd", "if=/dev/zero", f"of={target}", "bs=4k", "count=1", "conv=fsync"]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            left = max(1.0, deadline - time.monotonic())
            try:
                fs.node_exec(node, argv, timeout_s=left)
            except FileServerError as exc:  # EIO while a client reconnects: again
                errors[node] = str(exc)
                time.sleep(0.2)
                continue
            done[node] = time.time()
            return

    threads = [threading.Thread(target=probe, args=(n,), daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 35.0)
    missing = [n for n in nodes if n not in done]
    if missing:
        raise FileServerError(
            f"the {fs.kind} mount of {', '.join(missing)} took no write for {timeout_s} s "
            f"after the fault cleared: {errors}"
        )
    return max(done.values())


def _trained(work: Path) -> int:
    rows = timing_log(work)
    return rows[-1][1] if rows else 0


def _at_step(work: Path, step: int) -> bool:
    return _trained(work) >= step


def _wait_durable(ckpt: Path, step: int, timeout_s: float) -> float | None:
    """When the export's newest committed step reached ``step`` (None: not within)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        newest = newest_committed(ckpt)
        if newest is not None and newest >= step:
            return time.time()
        time.sleep(0.05)
    return None


def _stall_ended_after(stalled: Sequence[dict[str, Any]], w: Window) -> float | None:
    """Seconds from the mounts answering to the end of the last persist stall reported
    between then and the step's durability (None: no stall ended then)."""
    until = w.durable_at if w.durable_at is not None else float("inf")
    ended = [
        e["time"]
        for e in stalled
        if e.get("ongoing") is False and w.answered_at < e["time"] <= until
    ]
    return max(ended) - w.answered_at if ended else None


def analyze(
    windows: Sequence[Window], timing: Sequence[tuple[float, int]], evs: Sequence[dict[str, Any]]
) -> list[FaultOutcome]:
    """Per fault: steps trained again, the longest gap between two steps from the fault's
    start until its step was durable (or the next fault), the step rate during it against
    the same span before it, and how long its newest step took to become durable."""
    out: list[FaultOutcome] = []
    for i, w in enumerate(windows):
        until = windows[i + 1].begin if i + 1 < len(windows) else float("inf")
        recovered = min(until, w.durable_at or w.answered_at + 30.0)
        span = [(t, s) for t, s in timing if w.begin <= t <= recovered]
        before = [(t, s) for t, s in timing if t < w.begin]
        # the gap that spans the fault's start counts too: the step before it, then the next
        prev = before[-1:] if before else []
        rows = prev + span
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows)]
        if not span:  # no step at all while it lasted: the whole time is one gap
            gaps.append(recovered - (prev[0][0] if prev else w.begin))
        held = w.end - w.begin
        during = sum(1 for t, _ in timing if w.begin <= t <= w.end) / held if held else 0.0
        # as long before it, but not the first seconds of training (warming up)
        since = max(w.begin - held, timing[0][0] + 2.0) if timing else w.begin
        earlier = sum(1 for t, _ in timing if since <= t < w.begin)
        earlier_rate = earlier / (w.begin - since) if w.begin > since else 0.0
        seen_until = [s for t, s in timing if t <= until]
        steps_lost = len(seen_until) - len(set(seen_until))
        stalled = [
            e
            for e in evs
            if e.get("event") == "persist_stalled" and w.begin <= e.get("time", 0) <= recovered + 1
        ]
        out.append(
            FaultOutcome(
                kind=w.kind,
                held_s=held,
                steps_lost=steps_lost - sum(o.steps_lost for o in out),
                longest_gap_s=max(gaps, default=0.0),
                rate_ratio=during / earlier_rate if earlier_rate else 0.0,
                durable_after_s=None if w.durable_at is None else w.durable_at - w.answered_at,
                answered_after_s=w.answered_at - w.end,
                stalled_events=len(stalled),
                stall_ended_after_s=_stall_ended_after(stalled, w),
            )
        )
    return out
