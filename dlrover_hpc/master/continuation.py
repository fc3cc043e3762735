"""Time limits and preemption: end at a step boundary, keep that step, go on in a new run.

Slurm ends a job at its time limit, or when it is preempted, with a signal and, ``KillWait``
seconds later, SIGKILL.  The job script asks for ``--signal=B:USR1@120`` and hands the signal
to the master (``dlrover-hpc stop``); the master also acts on its own ahead of the time limit
(``squeue %L``), for jobs submitted without the signal.  Then:

1. the master picks the step to stop at (:func:`stop_step`): past every rank's newest step by
   the steps that train while the notice travels, and tells the agents (``stop_at``);
2. every rank's first flash-checkpoint save at or after that step is persisted, and the rank
   exits once the step is committed (``dlrover_hpc.progress.stop_requested``);
3. the job ends with ``time_limit_reached`` or ``job_preempted`` (the committed step) and a
   continuation (:class:`Continuer`): ``scontrol requeue`` when the job is requeueable, else
   the same script submitted again with ``--dependency=afterany``, up to
   ``--max-continuations`` times.  The next run restores the step from storage.

When the workers do not reach a save by the deadline, the job ends anyway: the agents persist
the newest step in memory (as after a failure) and the committed one is reported.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from dlrover_hpc import environ
from dlrover_hpc.events import EventName
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.slurm import commands as slurm

log = logging.getLogger(__name__)

#: the number of continuations before this run (0: the first run), set on a resubmitted job
COUNT_ENV = environ.CONTINUATION
#: the file in the job directory counting the requeues this module made
COUNT_FILE = "continuations"
#: extra sbatch options for a resubmitted job (options given on sbatch's command line are not
#: visible to the job: ``--signal``, ``--mem``... written in the script itself are kept)
OPTS_ENV = environ.CONTINUE_OPTS
#: variables of this job that must not leak into the next one (it makes its own)
_DROP = environ.NOT_CONTINUED
#: Set by the user or the site, not by this job: which cluster's configuration to talk to.
_KEEP = ("SLURM_CONF",)


class StopKind(enum.StrEnum):
    TIME_LIMIT = "time_limit"
    PREEMPTED = "preempted"

    @property
    def event(self) -> EventName:
        if self is StopKind.TIME_LIMIT:
            return EventName.TIME_LIMIT_REACHED
        return EventName.JOB_PREEMPTED


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StopPlan:
    kind: StopKind
    reason: str
    #: the ranks stop at their first save at or after this step (-1: no round was running)
    step: int
    #: wall clock by which the job ends, saved or not
    deadline: float


def stop_step(newest: int, step_rate: float, notice_s: float, *, least: int = 2) -> int:
    """The step to stop at (pure): past ``newest`` (the furthest rank's step) by the steps
    trained while the notice reaches every rank (``notice_s`` at ``step_rate`` steps per
    second), and by at least ``least``, so that no rank is past it when it reads it."""
    ahead = math.ceil(step_rate * notice_s) if step_rate > 0 else 0
    return max(newest, 0) + max(least, ahead)


#: a signal this close to the time limit announces it (the templates ask 120 s ahead)
TIME_LIMIT_NEAR_S = 900.0


def stop_kind(time_left_s: float | None, lead_s: float) -> StopKind:
    """What a signal announces: the time limit when it is near, else a preemption."""
    if time_left_s is not None and time_left_s <= max(lead_s, TIME_LIMIT_NEAR_S) + 60:
        return StopKind.TIME_LIMIT
    return StopKind.PREEMPTED


_NUMBERED = re.compile(r"(?<![0-9])([0-9]+)(?![0-9])")


def _with_job_pattern(path: str, job_id: str) -> str:
    """An output file named after the old job gets ``%j`` in its name again."""
    head, name = os.path.split(path)
    name = _NUMBERED.sub(lambda m: "%j" if m.group(1) == job_id else m.group(1), name)
    return os.path.join(head, name)


def resubmit_argv(
    job: Mapping[str, str],
    *,
    job_id: str,
    script: str,
    args: Sequence[str],
    count: int,
    environ: Mapping[str, str],
    extra: Sequence[str] = (),
) -> list[str]:
    """``sbatch`` for the next run of the job described by ``scontrol show job`` (pure): the
    same script, arguments, nodes, time limit, partition, name, directory and output files,
    after the old job ends; run under ``env -u`` so this job's variables do not leak in."""
    unset = sorted(
        k
        for k in environ
        if k in _DROP or (k.startswith(("SLURM_", "SBATCH_", "SALLOC_")) and k not in _KEEP)
    )
    argv = ["env", *(a for k in unset for a in ("-u", k)), "sbatch", "--parsable"]
    argv += [f"--dependency=afterany:{job_id}", f"--export=ALL,{COUNT_ENV}={count}"]
    simple = {
        "NumNodes": "--nodes",
        "TimeLimit": "--time",
        "Partition": "--partition",
        "JobName": "--job-name",
        "WorkDir": "--chdir",
        "Account": "--account",
        "QOS": "--qos",
    }
    for key, flag in simple.items():
        value = job.get(key, "")
        if value and value not in ("(null)", "UNLIMITED", "N/A"):
            argv.append(f"{flag}={value}")
    for key, flag in (("StdOut", "--output"), ("StdErr", "--error")):
        if job.get(key) and job[key] != "/dev/null":
            argv.append(f"{flag}={_with_job_pattern(job[key], job_id)}")
    mem = job.get("MinMemoryNode", "0")
    if mem and mem != "0":
        argv.append(f"--mem={mem}")
    if job.get("OverSubscribe") == "NO":
        argv.append("--exclusive")
    if job.get("Requeue") == "0":
        argv.append("--no-requeue")
    gres = job.get("TresPerNode", "")
    if gres and gres != "(null)":
        argv.append(f"--gres={gres.removeprefix('gres:').replace('gres:', '')}")
    return [*argv, *extra, script, *args]


class Continuer:
    """Continues the job in a new run: requeue or resubmission; runs Slurm commands (call it
    from a worker thread)."""

    def __init__(
        self,
        *,
        job_id: str,
        job_dir: Path,
        events: EventLog,
        max_continuations: int,
        script: str | None,
        run: slurm.Runner = slurm.run_command,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.job_id, self.job_dir, self.events = job_id, job_dir, events
        self.max_continuations, self.script, self._run = max_continuations, script, run
        self._environ = dict(os.environ if environ is None else environ)

    def count(self) -> int:
        """Continuations before this run: by resubmission (the environment) or requeue."""
        try:
            requeued = int((self.job_dir / COUNT_FILE).read_text().strip() or 0)
        except (OSError, ValueError):
            requeued = 0
        try:
            resubmitted = int(self._environ.get(COUNT_ENV, "0") or 0)
        except ValueError:
            resubmitted = 0
        return max(requeued, resubmitted)

    def time_left(self) -> float | None:
        return slurm.time_left(self.job_id, run=self._run)

    def cancelled(self) -> bool:
        """The job is being cancelled (``scancel``): a signal that must not continue it."""
        try:
            state = slurm.show_job(self.job_id, run=self._run).get("JobState", "")
        except Exception:  # thread boundary: unknown counts as not cancelled
            log.exception("scontrol show job failed job=%s", self.job_id)
            return False
        return state.startswith("CANCELLED")

    def continue_job(self, plan: StopPlan, step: int) -> str | None:
        """Starts the next run; returns its job id (this one's for a requeue), or None when
        the limit is reached or Slurm refused (logged, and in ``job_continued``'s absence)."""
        done = self.count()
        if done >= self.max_continuations:
            log.warning(
                "no continuation: %d of --max-continuations=%d used; resubmit by hand to go "
                "on from step %d",
                done,
                self.max_continuations,
                step,
            )
            return None
        try:
            return self._continue(plan, step, done + 1)
        except Exception as exc:  # thread boundary: the job ends with what is committed
            log.exception("continuation failed job=%s", self.job_id)
            self.events.emit(
                EventName.REPLACEMENT_FAILED,
                reason=f"continuation failed: {exc}",
                next_action="resubmit the job by hand; it resumes from the committed step",
            )
            return None

    def _continue(self, plan: StopPlan, step: int, count: int) -> str:
        job = slurm.show_job(self.job_id, run=self._run)
        fields = {"kind": plan.kind.value, "step": step, "continuation": count}
        if job.get("Requeue") == "1":
            path = self.job_dir / COUNT_FILE
            tmp = path.with_suffix(".tmp")
            tmp.write_text(f"{count}\n")
            os.replace(tmp, path)
            # Slurm ends this job's processes (this one too): say it first.
            self.events.emit(EventName.JOB_CONTINUED, job=self.job_id, how="requeue", **fields)
            log.warning("job continues by requeue job=%s step=%d", self.job_id, step)
            slurm.requeue_job(self.job_id, run=self._run)
            return self.job_id
        script = self.script or job.get("Command", "").split(" ")[0]
        argv = resubmit_argv(
            job,
            job_id=self.job_id,
            script=script,
            args=self._run_args(),
            count=count,
            environ=self._environ,
            extra=shlex.split(self._environ.get(OPTS_ENV, "")),
        )
        new_id = slurm.submit(argv, run=self._run)
        self.events.emit(EventName.JOB_CONTINUED, job=new_id, how="resubmit", **fields)
        log.warning("job continues as job=%s step=%d argv=%s", new_id, step, shlex.join(argv))
        return new_id

    def _run_args(self) -> list[str]:
        """The agents' arguments, saved by the job script (``run-args``, NUL-separated)."""
        try:
            raw = (self.job_dir / "run-args").read_bytes()
        except OSError:
            return []
        return [a.decode() for a in raw.split(b"\0")[:-1]]
