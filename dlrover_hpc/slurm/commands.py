"""The only place that runs Slurm's binaries: argv lists, timeouts, parsed results.

One backend: Slurm's command-line tools. pyslurm, which would call libslurm in-process, has no
release for the Slurm the tests run (22.05; the package index has pyslurm 25.11 and 18.08 and
older, and each release builds only against its own Slurm major), so it is not offered:
``cli`` as :data:`environ.SLURM_BACKEND` is accepted, anything else is refused
(:func:`check_backend`).
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from typing import Protocol

from dlrover_hpc import environ
from dlrover_hpc.errors import ConfigError, SlurmError
from dlrover_hpc.slurm.hostnames import collect, expand
from dlrover_hpc.slurm.parse import SlurmNode, parse_oneliner, parse_show_nodes, parse_time_left

log = logging.getLogger(__name__)

BACKEND_ENV = environ.SLURM_BACKEND
BACKENDS = ("cli",)


def check_backend(environ: Mapping[str, str]) -> str:
    """The Slurm backend the environment asks for; a ConfigError for one not offered."""
    wanted = environ.get(BACKEND_ENV, "").strip() or "cli"
    if wanted in BACKENDS:
        return wanted
    why = (
        "pyslurm has no release for this Slurm on the package index, so dlrover-hpc runs "
        "Slurm's commands (see the README, 'Slurm: commands, not pyslurm')"
        if wanted == "pyslurm"
        else f"expected one of: {', '.join(BACKENDS)}"
    )
    raise ConfigError(f"{BACKEND_ENV}={wanted}: not a backend here; {why}; unset it or set cli")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> Completed: ...


def run_command(argv: Sequence[str], *, timeout_s: float) -> Completed:
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError:
        raise SlurmError(
            f"{argv[0]}: not found; is Slurm's client installed on this node?"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{shlex.join(argv)}: no answer within {timeout_s:.0f} s") from None
    return Completed(
        argv=tuple(argv), returncode=proc.returncode, stdout=proc.stdout, stderr=proc.stderr
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DrainResult:
    ok: bool
    error: str
    admin_command: str


def _drain_argv(node: str, reason: str) -> list[str]:
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"]


def drain_node(
    node: str, *, reason: str, run: Runner = run_command, timeout_s: float = 30.0
) -> DrainResult:
    """Drain ``node``; Slurm allows it only to admins, so a refusal is a result, not an error."""
    argv = _drain_argv(node, reason)
    done = run(argv, timeout_s=timeout_s)
    admin = shlex.join(argv)
    if done.returncode == 0:
        log.info("node drained node=%s reason=%r", node, reason)
        return DrainResult(ok=True, error="", admin_command=admin)
    error = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
    log.warning("drain refused node=%s error=%r admin_command=%r", node, error, admin)
    return DrainResult(ok=False, error=error, admin_command=admin)


def _squeue_job(job_id: str, fields: str, *, run: Runner, timeout_s: float) -> str:
    """``squeue -h -j J -o FIELDS``'s line for the job ("" when Slurm no longer lists it)."""
    done = run(["squeue", "-h", "-j", job_id, "-o", fields], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"squeue -j {job_id} failed: {done.stderr.strip()}")
    return done.stdout.strip()


def job_nodes(job_id: str, *, run: Runner = run_command, timeout_s: float = 15.0) -> list[str]:
    """Nodes the job holds now (SLURM_JOB_NODELIST goes stale when a node is lost)."""
    nodes = _squeue_job(job_id, "%N", run=run, timeout_s=timeout_s)
    return expand(nodes, source=f"squeue -j {job_id}")


def job_state_and_nodes(
    job_id: str, *, run: Runner = run_command, timeout_s: float = 15.0
) -> tuple[str, list[str]]:
    """The job's state (``RUNNING``, ``CANCELLED``, ...; "" once it ended: a cancelled job is
    gone from squeue at once) and the nodes it holds now, from one squeue."""
    state, _, nodes = _squeue_job(job_id, "%T %N", run=run, timeout_s=timeout_s).partition(" ")
    return state, expand(nodes.strip(), source=f"squeue -j {job_id}")


def show_node(node: str, *, run: Runner = run_command, timeout_s: float = 15.0) -> dict[str, str]:
    done = run(["scontrol", "-o", "show", "node", node], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"scontrol show node {node} failed: {done.stderr.strip()}")
    return parse_oneliner(done.stdout, free_text_last="Reason")


def show_nodes(
    nodes: Sequence[str], *, run: Runner = run_command, timeout_s: float = 10.0
) -> dict[str, SlurmNode]:
    """The Slurm state of each of ``nodes``, from ONE ``scontrol -o show node HOSTLIST`` (the
    names compressed: ``node[1-4096]``).  A node Slurm does not know is left out (scontrol
    then exits 1 but prints the others); no node printed at all is a :class:`SlurmError`."""
    hosts = collect(list(nodes))
    done = run(["scontrol", "-o", "show", "node", hosts], timeout_s=timeout_s)
    found = parse_show_nodes(done.stdout)
    if done.returncode != 0 and not found:
        error = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise SlurmError(f"scontrol show node {hosts} failed: {error}")
    return found


def requeue_job(job_id: str, *, run: Runner = run_command, timeout_s: float = 30.0) -> None:
    """Requeue the job.  Slurm ends its processes (the caller's too) and holds it about 120 s
    before it may start again; ``scontrol update JobId=J StartTime=now`` from outside lifts
    the hold."""
    argv = ["scontrol", "requeue", job_id]
    done = run(argv, timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} failed: {done.stderr.strip()}")


def show_job(job_id: str, *, run: Runner = run_command, timeout_s: float = 15.0) -> dict[str, str]:
    """``scontrol -o show job J`` as Key -> value (JobState, Requeue, TimeLimit, StdOut, ...)."""
    done = run(["scontrol", "-o", "show", "job", job_id], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"scontrol show job {job_id} failed: {done.stderr.strip()}")
    return parse_oneliner(done.stdout)


def my_job_ids(*, run: Runner = run_command, timeout_s: float = 15.0) -> frozenset[str]:
    """The ids of the caller's jobs that Slurm lists (pending, running, completing...)."""
    done = run(["squeue", "-h", "--me", "-o", "%A"], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"squeue --me failed: {done.stderr.strip()}")
    return frozenset(line.strip() for line in done.stdout.splitlines() if line.strip())


def cancel_job(job_id: str, *, run: Runner = run_command, timeout_s: float = 30.0) -> None:
    """``scancel J``: Slurm ends the job's processes (the caller's too) and frees its nodes."""
    argv = ["scancel", job_id]
    done = run(argv, timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"{shlex.join(argv)} failed: {done.stderr.strip()}")


def time_left(job_id: str, *, run: Runner = run_command, timeout_s: float = 15.0) -> float | None:
    """Seconds until the job's time limit (None: no limit).  ``squeue %L`` is relative, so no
    clock or time zone of slurmctld's enters (22.05 sets no SLURM_JOB_END_TIME)."""
    done = run(["squeue", "-h", "-j", job_id, "-o", "%L"], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"squeue -j {job_id} -o %L failed: {done.stderr.strip()}")
    return parse_time_left(done.stdout)


def submit(argv: Sequence[str], *, run: Runner = run_command, timeout_s: float = 60.0) -> str:
    """Runs ``sbatch --parsable ...``; returns the new job's id, raises with Slurm's reason."""
    done = run(argv, timeout_s=timeout_s)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise SlurmError(f"{shlex.join(argv)} failed: {reason}")
    return done.stdout.strip().split(";")[0]


def node_states(
    nodes: Sequence[str], *, run: Runner = run_command, timeout_s: float = 15.0
) -> dict[str, str]:
    """Node -> compact state (``sinfo %t``: ``alloc``, ``mix``, ``idle*``, ``down*``, ``drng``).
    A ``*`` suffix: the node does not respond."""
    done = run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], timeout_s=timeout_s)
    if done.returncode != 0:
        raise SlurmError(f"sinfo -n {','.join(nodes)} failed: {done.stderr.strip()}")
    return parse_node_states(done.stdout)


def parse_node_states(text: str) -> dict[str, str]:
    """``sinfo -h -N -o "%N %t"`` output; a node in several partitions appears once."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.setdefault(parts[0], parts[1])
    return out
