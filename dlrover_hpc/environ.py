"""The environment dlrover-hpc's processes hand one another: the one place its names are spelt.

A user's settings (``dlrover-run``'s and ``dlrover-hpc master``'s flags, each with its variable)
are declared in :mod:`dlrover_hpc.settings`.  This module names the rest:

- what an agent puts into each of its workers (:class:`WorkerEnv`, through
  :meth:`WorkerEnv.to_environ` and read back with :meth:`WorkerEnv.from_environ`), and the
  per-worker names beside it (the progress record, the round, the requeue owner);
- what the master puts into the jobs and steps it starts (replacements, relaunched agents,
  continuations);
- switches read in one process only (the event loop, the Slurm backend, the zygote's preloads,
  the checkpoint's directories, a test's crash point).

Every name starts with :data:`PREFIX`, so a launcher can forward them all by prefix.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

PREFIX = "DLROVER_HPC_"

# ------------------------------------------------------------------ agent -> worker
#: The job master, ``HOST:PORT`` (a worker's data-sharding client dials it; also a setting).
MASTER = PREFIX + "MASTER"
#: The job directory (also a setting).
JOB_DIR = PREFIX + "JOB_DIR"
#: The job's id (the Slurm job id, or ``standalone``): names the shared-memory segments.
JOB_ID = PREFIX + "JOB_ID"
#: The node's name as the master knows it.
NODE_NAME = PREFIX + "NODE_NAME"
#: The agent's flash-checkpoint saver (a Unix socket); unset: the worker saves in-process.
SAVER_SOCKET = PREFIX + "SAVER_SOCKET"
#: The job token (authenticates every connection to the master); unset: the job dir's file.
TOKEN = PREFIX + "TOKEN"
#: The rendezvous round the worker was started in (the data-sharding client's incarnation).
ROUND = PREFIX + "ROUND"
#: The worker's progress record in node-local memory (:mod:`dlrover_hpc.worker.progress`).
PROGRESS_FILE = PREFIX + "PROGRESS_FILE"
#: ``1``: the worker hooks time each forward pass (a few percent of a small step).
FORWARD_TIMING = PREFIX + "FORWARD_TIMING"
#: Who takes Slurm's USR1: ``framework`` lets the worker's own handler have it.
REQUEUE_BY = PREFIX + "REQUEUE_BY"
#: The agent's own value of a Slurm task variable the worker's copy rewrites
#: (``AGENT_PREFIX + "SLURM_PROCID"``).
AGENT_PREFIX = PREFIX + "AGENT_"
#: How long the in-process wrapper waits for the agent's word after a broken collective.
INPROCESS_WAIT_S = PREFIX + "INPROCESS_WAIT_S"

# ------------------------------------------------------------------ checkpoint (worker side)
#: Where shared-memory segments live; ``/dev/shm`` unless set.
SHM_DIR = PREFIX + "SHM_DIR"
#: Where a DISK save goes on its way to storage when shared memory has no room for it.
SPILL_DIR = PREFIX + "SPILL_DIR"
#: The node-local checkpoint tier (``--local-ckpt-dir``): steps go there before the shared
#: directory, and a restore reads them there first.
LOCAL_CKPT_DIR = PREFIX + "LOCAL_CKPT_DIR"
#: ``0``/``false``/``off``: no device-side snapshot of CUDA tensors before the copy to memory.
CKPT_DEVICE_SNAPSHOT = PREFIX + "CKPT_DEVICE_SNAPSHOT"
#: A crash trial's kill point (benchmarks/checkpoint_crash.py), read by the saver.
CRASH_KILL_AT = PREFIX + "CRASH_KILL_AT"

# ------------------------------------------------------------------ master -> jobs it starts
#: A replacement job's: the job id of the job it replaces.
REPLACES = PREFIX + "REPLACES"
#: The job's sbatch script (the master resubmits it to continue the job).
SBATCH_SCRIPT = PREFIX + "SBATCH_SCRIPT"
#: How many times this job has been continued (a new run after a time limit or preemption).
CONTINUATION = PREFIX + "CONTINUATION"
#: The Python of the dlrover-hpc installation a job's sbatch script runs (its bin directory's
#: dlrover-run and dlrover-hpc go first on PATH); the written templates carry their own.
PYTHON = PREFIX + "PYTHON"
#: Extra sbatch options of a continuation.
CONTINUE_OPTS = PREFIX + "CONTINUE_OPTS"
#: The names a continuation does not inherit: the old run's master, token and directory.
NOT_CONTINUED = (JOB_DIR, TOKEN, MASTER, CONTINUATION)

# ------------------------------------------------------------------ one process's switches
#: ``auto`` (uvloop when installed), ``asyncio`` or ``uvloop``.
EVENT_LOOP = PREFIX + "EVENT_LOOP"
#: How dlrover-hpc talks to Slurm: ``cli`` (scontrol, sbatch, squeue), the only backend.
SLURM_BACKEND = PREFIX + "SLURM_BACKEND"
#: A local Slurm node's id (the local Slurm's nodes share one host).
SLURM_NODE_ID = PREFIX + "SLURM_NODE_ID"
#: Modules the agent's zygote imports once for every worker (comma-separated).
PRELOAD = PREFIX + "PRELOAD"
#: The log level of every command, when no ``--log-level`` says (default INFO).
LOG_LEVEL = PREFIX + "LOG_LEVEL"


def name(key: str) -> str:
    """A setting's variable: ``max_restarts`` -> ``DLROVER_HPC_MAX_RESTARTS``."""
    return PREFIX + key.upper().replace("-", "_")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnv:
    """What an agent tells each of its workers about the job (beside torchrun's variables)."""

    master: str | None = None  # HOST:PORT
    job_dir: str | None = None
    job_id: str | None = None
    node_name: str | None = None
    saver_socket: str | None = None  # None: the worker saves in-process
    progress_file: str | None = None
    forward_timing: bool = False
    round: int | None = None

    def to_environ(self) -> dict[str, str]:
        """The variables, only those that are set."""
        values = {
            MASTER: self.master,
            JOB_DIR: self.job_dir,
            JOB_ID: self.job_id,
            NODE_NAME: self.node_name,
            SAVER_SOCKET: self.saver_socket,
            PROGRESS_FILE: self.progress_file,
            FORWARD_TIMING: "1" if self.forward_timing else "0",
            ROUND: None if self.round is None else str(self.round),
        }
        return {key: value for key, value in values.items() if value is not None}

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """The worker's view (a missing variable is None; a bad round is an error of the
        agent's, not the script's, and reads as None)."""
        env = os.environ if env is None else env
        round_text = env.get(ROUND, "")
        return cls(
            master=env.get(MASTER) or None,
            job_dir=env.get(JOB_DIR) or None,
            job_id=env.get(JOB_ID) or None,
            node_name=env.get(NODE_NAME) or None,
            saver_socket=env.get(SAVER_SOCKET) or None,
            progress_file=env.get(PROGRESS_FILE) or None,
            forward_timing=env.get(FORWARD_TIMING, "0") == "1",
            round=int(round_text) if round_text.lstrip("-").isdigit() else None,
        )
