"""Starting an agent again on a node the job still holds: ``srun --overlap -w NODE``.

The decision is :func:`dlrover_hpc.master.relaunch_plan.relaunches`; this module runs the Slurm
commands.  The new agent gets the lost agent's own command line and working directory (from
its ``Join``) and the master's environment (the job token, the job directory), plus the
master's address and the node's index in the allocation so its rank order is kept.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
from pathlib import Path

from dlrover_hpc import environ
from dlrover_hpc.errors import SlurmError
from dlrover_hpc.events import EventName
from dlrover_hpc.master.decisions import Relaunch
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.relaunch_plan import relaunches
from dlrover_hpc.slurm import commands as slurm
from dlrover_hpc.slurm.env import NODE_ID_ENV

log = logging.getLogger(__name__)

#: Variables of the master's own job step: the relaunch is a new step of the same job.
_STEP_VARS = (
    "SLURM_STEP",
    "SLURM_STEPID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_TASK_PID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_NNODES",
    "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_SRUN_COMM",
    "SLURM_DISTRIBUTION",
    "SLURM_CPU_BIND",
    "SLURM_LAUNCH_NODE_IPADDR",
    "SLURM_UMASK",
    "SLURM_PRIO_PROCESS",
)


class SrunLauncher:
    """Relaunched agents' ``srun`` processes, one per node at a time."""

    def __init__(self, *, job_id: str, job_dir: Path, master_addr: str) -> None:
        self.job_id, self.job_dir, self.master_addr = job_id, job_dir, master_addr
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._count = 0

    def allocation(self) -> dict[str, str]:
        """Node -> compact ``sinfo`` state, for the nodes the job holds now (a thread)."""
        nodes = slurm.job_nodes(self.job_id)
        return slurm.node_states(nodes) if nodes else {}

    def argv(self, node: str, launch_argv: tuple[str, ...], cwd: str) -> list[str]:
        return [
            "srun",
            f"--jobid={self.job_id}",
            "--overlap",
            "--no-kill",
            "--kill-on-bad-exit=0",
            "-N1",
            "-n1",
            f"--nodelist={node}",
            f"--job-name=dlrover-hpc-relaunch-{node}",
            *([f"--chdir={cwd}"] if cwd else []),
            *launch_argv,
        ]

    def launch(
        self, node: str, launch_argv: tuple[str, ...], cwd: str, node_id: int | None
    ) -> bool:
        """Start the step (it runs until its agent exits); False when srun could not start."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_STEP_VARS)}
        env[environ.MASTER] = self.master_addr
        env[environ.JOB_DIR] = str(self.job_dir)
        if node_id is not None:
            env[NODE_ID_ENV] = str(node_id)
        stale = self.procs.pop(node, None)
        if stale is not None and stale.poll() is None:  # an srun that never got through
            stale.kill()
            stale.wait()
        self._count += 1
        out = self.job_dir / f"relaunch-{node}-{self._count}.out"
        argv = self.argv(node, launch_argv, cwd)
        try:
            with open(out, "wb") as f:
                self.procs[node] = subprocess.Popen(
                    argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
        except OSError as exc:
            log.error("relaunch could not start srun node=%s error=%s", node, exc)
            return False
        log.info("relaunch started node=%s output=%s", node, out)
        return True

    def exited(self) -> dict[str, int]:
        """Nodes whose relaunch step ended since the last call, with srun's exit code."""
        ended = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
        for node in ended:
            del self.procs[node]
        return ended

    def stop_all(self) -> None:
        """The job is over: end relaunched steps whose agents did not exit on their own."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


class Relauncher:
    """The master's relaunch driver: the job's ``Relaunch`` actions in, srun steps out."""

    def __init__(self, job: Job, launcher: SrunLauncher) -> None:
        self.job, self.launcher = job, launcher
        job.relaunching_possible = True

    def relaunch(self, action: Relaunch) -> None:
        """Start a new agent on the node (srun: a fork and exec, quick enough for the loop);
        the job counts it in flight until it joins or its step ends."""
        rec = self.job.nodes[action.agent_id]
        self.job.relaunches.started(action.node, self.job.clock())
        log.warning("relaunching the agent node=%s attempt=%d", action.node, action.attempt)
        self.job.emit(
            EventName.NODE_RELAUNCHED,
            node=action.node,
            agent=action.agent_id,
            attempt=action.attempt,
        )
        if not self.launcher.launch(
            action.node, rec.launch_argv, rec.launch_cwd, rec.slurm_node_id
        ):
            self.job.relaunches.ended(action.node, self.job.clock())

    async def run(self) -> None:
        """Notice relaunch steps that ended, look at the allocation while a lost node might be
        relaunched, and start the relaunches the plan asks for."""
        launcher, job = self.launcher, self.job
        while True:
            await asyncio.sleep(1.0)
            for node, code in launcher.exited().items():
                if job.relaunches.ended(node, job.clock()):
                    log.warning("relaunch failed node=%s srun_exit=%d", node, code)
                    job.poke()
            if job.ended or not any(n.state is NodeState.LOST for n in job.nodes.values()):
                continue
            taken_at = job.clock()
            try:
                allocation = await asyncio.to_thread(launcher.allocation)
            except SlurmError as exc:
                log.warning("cannot look at the job's allocation error=%s", exc)
                continue
            job.relaunches.allocation_at, job.relaunches.allocation = taken_at, allocation
            job.apply(
                relaunches(
                    list(job.nodes.values()),
                    excluded_nodes=job.excluded_nodes,
                    allocation=allocation,
                    attempts=job.relaunches.attempts,
                    now=job.clock(),
                )
            )
