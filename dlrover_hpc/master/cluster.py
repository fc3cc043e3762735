"""What the master asks of the machines a job runs on, behind one interface.

The job logic (:mod:`.job`, :mod:`.stopping`) decides *that* a node is taken out, that a node
is replaced, that a lost node's agent is started again or that the job continues before its
time limit; a :class:`Cluster` says *whether and how* (torch elastic's RendezvousHandler seam:
one interface the master calls, backends behind it).  Slurm does all of it (``scontrol``,
``sbatch``, ``srun``, ``squeue``) and says what state its nodes are in (the live node states,
:mod:`.node_states`); a bare-metal job (the SSH launcher) or a job outside Slurm
only takes a node out (quarantine; ``--drain=scontrol`` is tried and refused there, as before).

The host that runs the master picks the cluster (:func:`from_env` for the master command, an
embedded, standalone or promoted master; :class:`SshCluster` for the SSH launcher) and hands it
to :func:`dlrover_hpc.master.assembly.build_master`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

from dlrover_hpc import environ
from dlrover_hpc.config import MasterConfig
from dlrover_hpc.master.continuation import Continuer
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.master.node_states import POLL_TIMEOUT_S, ReadStates
from dlrover_hpc.master.policy import NodeRemover
from dlrover_hpc.master.relaunch import SrunLauncher
from dlrover_hpc.master.replace import Replacer
from dlrover_hpc.slurm import commands as slurm
from dlrover_hpc.slurm.parse import SlurmNode


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Site:
    """The job every cluster's parts are made for."""

    config: MasterConfig
    job_dir: Path
    events: EventLog


class Cluster(Protocol):
    """The master's view of the machines: each part, or None where this cluster has none.

    Each is asked for once (the parts that start agents once the master listens at
    ``master_addr``, HOST:PORT); the parts run Slurm (or other) commands and are called from
    worker threads, never on the event loop."""

    def remover(self, site: Site) -> NodeRemover:
        """Takes a faulty node out of the job (drain, or quarantine)."""
        ...

    def replacer(self, site: Site, master_addr: str) -> Replacer | None:
        """Asks for new nodes in place of lost ones, and requeues the job."""
        ...

    def launcher(self, site: Site, master_addr: str) -> SrunLauncher | None:
        """Starts a lost node's agent again on a node of the allocation (reads node states)."""
        ...

    def continuer(self, site: Site) -> Continuer | None:
        """Continues the job at its time limit (requeue, or a new job); None: the workers'
        framework does (``--requeue-by=framework``), or nothing can."""
        ...

    def node_states(self, site: Site) -> ReadStates | None:
        """Reads the resource manager's state of the given nodes, in one call for them all
        (:mod:`dlrover_hpc.master.node_states`); None: there is none to ask."""
        ...


def _remover(site: Site) -> NodeRemover:
    config = site.config
    return NodeRemover(
        mode=config.drain, job_id=config.job_id, job_dir=site.job_dir, events=site.events
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlurmCluster:
    """A job inside the Slurm allocation ``job_id``; ``script``: the batch script a
    continuation submits again (:data:`environ.SBATCH_SCRIPT`)."""

    job_id: str
    script: str | None = None

    def remover(self, site: Site) -> NodeRemover:
        return _remover(site)

    def replacer(self, site: Site, master_addr: str) -> Replacer | None:
        return Replacer(
            job_id=self.job_id,
            job_dir=site.job_dir,
            template=site.config.replacement_sbatch,
            master_addr=master_addr,
            events=site.events,
        )

    def launcher(self, site: Site, master_addr: str) -> SrunLauncher | None:
        return SrunLauncher(job_id=self.job_id, job_dir=site.job_dir, master_addr=master_addr)

    def continuer(self, site: Site) -> Continuer | None:
        return Continuer(
            job_id=self.job_id,
            job_dir=site.job_dir,
            events=site.events,
            max_continuations=site.config.max_continuations,
            script=self.script,
        )

    def node_states(self, site: Site) -> ReadStates | None:
        return _show_nodes


def _show_nodes(nodes: Sequence[str]) -> Mapping[str, SlurmNode]:
    """One ``scontrol -o show node HOSTLIST`` for every node of the job."""
    return slurm.show_nodes(nodes, timeout_s=POLL_TIMEOUT_S)


class NoCluster:
    """No resource manager (a master outside Slurm, ``--standalone`` on a workstation): nodes
    are only taken out; none is replaced, relaunched or continued."""

    def remover(self, site: Site) -> NodeRemover:
        return _remover(site)

    def replacer(self, site: Site, master_addr: str) -> Replacer | None:
        return None

    def launcher(self, site: Site, master_addr: str) -> SrunLauncher | None:
        return None

    def continuer(self, site: Site) -> Continuer | None:
        return None

    def node_states(self, site: Site) -> ReadStates | None:
        return None


class SshCluster(NoCluster):
    """Hosts from a hostfile, started over SSH (:mod:`dlrover_hpc.ssh`): the launcher keeps its
    spare hosts itself, so the master only takes nodes out."""


def from_env(env: Mapping[str, str] | None = None) -> Cluster:
    """Slurm when the master runs in a Slurm job (``SLURM_JOB_ID``), else no cluster."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if job_id:
        return SlurmCluster(job_id=job_id, script=env.get(environ.SBATCH_SCRIPT))
    return NoCluster()
