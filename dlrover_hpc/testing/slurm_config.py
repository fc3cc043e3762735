"""What the local Slurm looks like, and the text of the files that describe it to Slurm.

:class:`LocalSlurmConfig` holds the shape of the cluster (nodes, addresses, bridges); the
functions render ``slurm.conf``, ``topology.conf`` and the nodes' ``/etc/hosts`` from it.  Pure:
writing the files is :class:`dlrover_hpc.testing.local_slurm.LocalSlurm`'s job.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dlrover_hpc.errors import LocalSlurmError

SLURM_CONF = Path("/etc/slurm/slurm.conf")
TOPOLOGY_CONF = Path("/etc/slurm/topology.conf")
MARK = "# written by dlrover-hpc local-slurm"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalSlurmConfig:
    """How the local cluster looks.  Addresses are ``<subnet>.<index>``, the bridge ``.254``."""

    nodes: int = 4
    prefix: str = "node"
    subnet: str = "10.77.0"
    state_dir: Path = Path("/var/lib/dlrover-hpc/local-slurm")
    cpus_per_node: int = 8
    memory_mb_per_node: int = 4096
    shm_size: str = "2g"
    topology: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise LocalSlurmError(f"--nodes {self.nodes}: expected 1 to 200 nodes")
        if not self.prefix.isidentifier():
            raise LocalSlurmError(f"node prefix {self.prefix!r}: use letters and digits only")

    def node_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.nodes + 1)]

    def address(self, node: str) -> str:
        return f"{self.subnet}.{int(node.removeprefix(self.prefix))}"

    data_subnet: str = "10.78.0"

    @property
    def bridge(self) -> str:
        return "dlhpc-br0"

    @property
    def data_bridge(self) -> str:
        """A second network ("the fabric", eth1 in each node) that can fail on its own."""
        return "dlhpc-br1"

    @property
    def controller_address(self) -> str:
        return f"{self.subnet}.254"


def slurm_conf_text(cfg: LocalSlurmConfig, *, host: str) -> str:
    """``slurm.conf`` for slurmctld on ``host`` and one slurmd per node, all run as root."""
    sd = cfg.state_dir
    node_lines = [
        f"NodeName={n} NodeAddr={cfg.address(n)} NodeHostname={n} CPUs={cfg.cpus_per_node} "
        f"RealMemory={cfg.memory_mb_per_node} State=UNKNOWN"
        for n in cfg.node_names()
    ]
    hostlist = f"{cfg.prefix}[1-{cfg.nodes}]" if cfg.nodes > 1 else f"{cfg.prefix}1"
    return f"""{MARK}; 'dlrover-hpc local-slurm down' removes it
ClusterName=dlrover-local
SlurmctldHost={host}({cfg.controller_address})
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={sd}/ctld
SlurmctldPidFile={sd}/slurmctld.pid
SlurmctldLogFile={sd}/log/slurmctld.log
SlurmdSpoolDir={sd}/spool/%n
SlurmdPidFile={sd}/slurmd-%n.pid
SlurmdLogFile={sd}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
TopologyPlugin=topology/tree
ReturnToService=1
JobRequeue=1
MpiDefault=none
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=1
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=300
{chr(10).join(node_lines)}
PartitionName=debug Nodes={hostlist} Default=YES MaxTime=INFINITE State=UP
"""


def topology_text(cfg: LocalSlurmConfig) -> str:
    """``topology.conf``: the configured switch list, else two leaves under one spine."""
    if cfg.topology is not None:
        from dlrover_hpc import topology  # converts a switch list to topology.conf

        parsed = topology.load(cfg.topology)
        return topology.render(parsed, topology.TopologyFormat.SLURM, header=MARK.lstrip("# "))
    # Default: two leaves of half the nodes each under one spine.
    names = cfg.node_names()
    half = max(1, len(names) // 2)
    leaves = [names[:half], names[half:]] if len(names) > 1 else [names]
    lines = [MARK]
    for i, members in enumerate(leaves, 1):
        if members:
            lines.append(f"SwitchName=leaf{i} Nodes={','.join(members)}")
    lines.append(f"SwitchName=spine1 Switches=leaf[1-{len([m for m in leaves if m])}]")
    return "\n".join(lines) + "\n"


def hosts_text(cfg: LocalSlurmConfig, *, host: str) -> str:
    """The nodes' ``/etc/hosts``: the controller (as ``host`` and ``slurmctld``) and every node."""
    hosts = ["127.0.0.1 localhost", f"{cfg.controller_address} {host} slurmctld"]
    hosts += [f"{cfg.address(n)} {n}" for n in cfg.node_names()]
    return "\n".join(hosts) + "\n"
