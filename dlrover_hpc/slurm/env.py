"""What a Slurm job step tells its processes through the environment."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from dlrover_hpc import environ
from dlrover_hpc.slurm.hostnames import expand

#: Set by the master on an agent it relaunches in a one-node step (whose SLURM_NODEID is 0):
#: the node's index in the job's allocation, so the rank order stays the same.
NODE_ID_ENV = environ.SLURM_NODE_ID


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlurmEnv:
    job_id: str
    nodes: tuple[str, ...]  # SLURM_JOB_NODELIST, expanded; stale once a node is lost
    node_id: int | None  # SLURM_NODEID: this node's index in the allocation
    node_name: str | None  # SLURMD_NODENAME
    proc_id: int | None
    local_id: int | None
    ntasks: int | None
    topology_addr: str | None  # e.g. "spine1.leaf1.node1"
    topology_addr_pattern: str | None  # e.g. "switch.switch.node"
    restart_count: int  # SLURM_RESTART_COUNT: times the job was requeued
    end_time: int | None  # SLURM_JOB_END_TIME (Unix seconds)
    submit_dir: str | None

    @property
    def switch_path(self) -> tuple[str, ...]:
        """Switches from the top down to this node's leaf, from SLURM_TOPOLOGY_ADDR."""
        if not self.topology_addr:
            return ()
        parts = self.topology_addr.split(".")
        return tuple(parts[:-1])


def _int(env: Mapping[str, str], key: str) -> int | None:
    value = env.get(key, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        return None


def parse_slurm_env(env: Mapping[str, str]) -> SlurmEnv | None:
    """The Slurm job this process runs in, or None outside Slurm."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return SlurmEnv(
        job_id=job_id,
        nodes=tuple(expand(nodelist, source="SLURM_JOB_NODELIST")),
        node_id=_int(env, NODE_ID_ENV) if env.get(NODE_ID_ENV) else _int(env, "SLURM_NODEID"),
        node_name=env.get("SLURMD_NODENAME") or None,
        proc_id=_int(env, "SLURM_PROCID"),
        local_id=_int(env, "SLURM_LOCALID"),
        ntasks=_int(env, "SLURM_NTASKS"),
        topology_addr=env.get("SLURM_TOPOLOGY_ADDR") or None,
        topology_addr_pattern=env.get("SLURM_TOPOLOGY_ADDR_PATTERN") or None,
        restart_count=_int(env, "SLURM_RESTART_COUNT") or 0,
        end_time=_int(env, "SLURM_JOB_END_TIME"),
        submit_dir=env.get("SLURM_SUBMIT_DIR") or None,
    )


#: The task-level variables a worker gets rewritten to its own rank, and where each value comes
#: from (a name of torchrun's environment). Lightning's SLURMEnvironment, submitit and many
#: scripts take the rank from these before torchrun's; under ``srun dlrover-run`` they are the
#: agent's task (one per node), so every worker of a node would claim the agent's rank.
TASK_VARIABLES = {
    "SLURM_PROCID": "RANK",
    "SLURM_LOCALID": "LOCAL_RANK",
    "SLURM_NTASKS": "WORLD_SIZE",
    "SLURM_NPROCS": "WORLD_SIZE",  # the older name of SLURM_NTASKS
    "SLURM_NODEID": "GROUP_RANK",
    "SLURM_NTASKS_PER_NODE": "LOCAL_WORLD_SIZE",
}
#: The agent's own value of a rewritten variable, kept for the worker under this prefix
#: (its ``SLURM_PROCID`` as ``AGENT_PREFIX + "SLURM_PROCID"``).
AGENT_PREFIX = environ.AGENT_PREFIX


def worker_task_env(
    agent_env: Mapping[str, str], torchrun_env: Mapping[str, str]
) -> dict[str, str]:
    """The Slurm task variables of one worker, in agreement with its torchrun variables.

    Only inside a Slurm job (``SLURM_JOB_ID``): a job over SSH gets no Slurm variables, which
    would make a framework think it runs under Slurm. The agent's own values are kept under
    :data:`AGENT_PREFIX`.
    """
    if not agent_env.get("SLURM_JOB_ID"):
        return {}
    out: dict[str, str] = {}
    for name, source in TASK_VARIABLES.items():
        if name == "SLURM_NPROCS" and name not in agent_env:
            continue  # Slurm 22.05 sets it; a newer one may not, nor should we
        if name in agent_env:
            out[AGENT_PREFIX + name] = agent_env[name]
        out[name] = torchrun_env[source]
    return out
