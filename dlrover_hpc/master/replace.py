"""Bringing capacity back under Slurm: a replacement job, or a requeue of the whole job.

Slurm cannot grow a running job, so after hot spares the master submits a *replacement job*
(``sbatch --exclude=<bad and busy nodes>`` of ``sbatch/replacement.sbatch``) whose agents join
this master over TCP with the job token; as a last resort it requeues its own job, which then
resumes from the journal and the persisted checkpoint.  Runs Slurm commands: call from a
worker thread.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from pathlib import Path

from dlrover_hpc import environ
from dlrover_hpc.events import EventName
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.slurm import commands as slurm
from dlrover_hpc.slurm.hostnames import collect

log = logging.getLogger(__name__)


class Replacer:
    def __init__(
        self,
        *,
        job_id: str,
        job_dir: Path,
        template: str | None,
        master_addr: str,
        events: EventLog,
        run: slurm.Runner = slurm.run_command,
    ) -> None:
        self.job_id, self.job_dir, self.template = job_id, job_dir, template
        self.master_addr, self.events, self._run = master_addr, events, run
        self.submitted: list[str] = []

    def request(self, count: int, exclude: Sequence[str]) -> str | None:
        """Submit a replacement job; None when it was submitted (or none is configured), else
        why Slurm refused it.  Never raises: it runs in a worker thread."""
        try:
            return self._request(count, exclude)
        except Exception as exc:  # thread boundary: the master retries, see replacement_failed
            log.exception("replacement request failed count=%d", count)
            return f"{type(exc).__name__}: {exc}"

    def _request(self, count: int, exclude: Sequence[str]) -> str | None:
        if not self.template:
            log.info("no replacement job: none configured (--replacement-sbatch)")
            return None
        # The nodes this job holds now, lost agents' nodes too (Slurm still counts them ours).
        state, held = slurm.job_state_and_nodes(self.job_id, run=self._run)
        if state != "RUNNING":
            # scancel ends the agents first: every node is lost at once, and a replacement
            # submitted then would outlive the job (its agents would even promote a master)
            log.warning("no replacement job: this job is %s", state)
            return f"the job is {state or 'gone'}"
        avoid = sorted({*exclude, *held})
        argv = [
            "sbatch",
            "--parsable",
            f"-N{count}",
            f"--job-name=dlrover-hpc-repl-{self.job_id}",
            f"--output={self.job_dir}/replacement-%j.out",
            # Never requeued by Slurm: a replacement whose node went DOWN (a link cut past
            # SlurmdTimeout) would be launched again after Slurm's 120 s hold, as a second
            # agent the master did not ask for, or onto the same node, still running the
            # first launch's step: Slurm then drains that healthy node ("Duplicate jobid").
            # The master asks for another replacement itself when it needs one.
            "--no-requeue",
            # The agents find this master and the job's token in the environment.
            f"--export=ALL,{environ.MASTER}={self.master_addr},"
            f"{environ.JOB_DIR}={self.job_dir},{environ.REPLACES}={self.job_id}",
        ]
        if avoid:
            argv.append(f"--exclude={collect(avoid)}")
        argv.append(self.template)
        done = self._run(argv, timeout_s=60)
        if done.returncode != 0:
            reason = sbatch_refusal(done.stderr) or f"sbatch exit code {done.returncode}"
            log.warning("replacement refused argv=%s reason=%s", shlex.join(argv), reason)
            return reason
        job = done.stdout.strip().split(";")[0]
        self.submitted.append(job)
        log.info("replacement job submitted job=%s nodes=%d exclude=%s", job, count, avoid)
        self.events.emit(EventName.REPLACEMENT_REQUESTED, job=job, count=count, exclude=avoid)
        return None

    def requeue(self, reason: str) -> None:
        try:
            self.events.emit(EventName.JOB_REQUEUED, job=self.job_id, reason=reason)
            slurm.requeue_job(self.job_id, run=self._run)
            log.warning("job requeued job=%s reason=%s", self.job_id, reason)
        except Exception:  # thread boundary
            log.exception("requeue failed job=%s", self.job_id)

    def cancel_all(self) -> None:
        """The job is over: replacement jobs still pending or running are not needed."""
        if self.submitted:
            self._run(["scancel", *self.submitted], timeout_s=30)


def sbatch_refusal(stderr: str) -> str:
    """Slurm's reason from sbatch's error output: its last ``error:`` line, without prefixes."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line] or lines
    if not errors:
        return ""
    reason = errors[-1].split("error:", 1)[-1].strip()
    return reason.removeprefix("Batch job submission failed:").strip()
