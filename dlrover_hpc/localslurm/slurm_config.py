"""What the local Slurm looks like, and the text of the files that describe it to Slurm.

:class:`LocalSlurmConfig` holds the shape of the cluster (nodes, addresses, bridges); the
functions render ``slurm.conf``, ``topology.conf`` and the nodes' ``/etc/hosts`` from it.  Pure:
writing the files is :class:`dlrover_hpc.localslurm.local_slurm.LocalSlurm`'s job.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dlrover_hpc.errors import LocalSlurmError

SLURM_CONF = Path("/etc/slurm/slurm.conf")
TOPOLOGY_CONF = Path("/etc/slurm/topology.conf")
MARK = "# written by dlrover-hpc local-slurm"


#: Where every local cluster keeps its state: ``local-slurm`` for cluster 0, ``local-slurmN``.
BASE_DIR = Path("/var/lib/dlrover-hpc")
MAX_INDEX = 99


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalSlurmConfig:
    """How the local cluster looks.  Addresses are ``<subnet>.<index>``, the bridge ``.254``.

    ``index`` tells several clusters on this machine apart (one per test worker side by side):
    cluster 0 is the default one (``/etc/slurm/slurm.conf``, ``dlhpc-br0``, 10.77.0.0/24);
    cluster N has its own name, state directory, ``slurm.conf`` (``SLURM_CONF`` points the
    Slurm commands at it), controller port, first job id, bridges, subnets (10.77.N, 10.78.N)
    and namespace names, so that nothing of one is seen by the other.  Node names are the same
    in every cluster (each node resolves the others through its own ``/etc/hosts``).
    """

    nodes: int = 4
    prefix: str = "node"
    index: int = 0
    cpus_per_node: int = 8
    memory_mb_per_node: int = 4096
    shm_size: str = "2g"
    topology: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200:
            raise LocalSlurmError(f"--nodes {self.nodes}: expected 1 to 200 nodes")
        if not self.prefix.isidentifier():
            raise LocalSlurmError(f"node prefix {self.prefix!r}: use letters and digits only")
        if not 0 <= self.index <= MAX_INDEX:
            raise LocalSlurmError(f"cluster index {self.index}: expected 0 to {MAX_INDEX}")

    def node_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.nodes + 1)]

    def address(self, node: str) -> str:
        return f"{self.subnet}.{int(node.removeprefix(self.prefix))}"

    @property
    def tag(self) -> str:
        """What the names of cluster N carry ("" for the default cluster 0)."""
        return str(self.index) if self.index else ""

    @property
    def cluster_name(self) -> str:
        return f"dlrover-local{self.tag}"

    @property
    def state_dir(self) -> Path:
        return BASE_DIR / f"local-slurm{self.tag}"

    @property
    def slurm_conf(self) -> Path:
        """``slurm.conf``: Slurm's default path for cluster 0, else in the state directory."""
        return SLURM_CONF if not self.index else self.state_dir / "etc" / "slurm.conf"

    @property
    def topology_conf(self) -> Path:
        """Slurm reads ``topology.conf`` beside ``slurm.conf``."""
        return self.slurm_conf.with_name("topology.conf")

    @property
    def controller_port(self) -> int:
        return 6817 if not self.index else 7000 + self.index

    @property
    def first_job_id(self) -> int:
        """Job ids of two clusters never meet (names in /tmp carry the job id and the node)."""
        return 1 + 100_000 * self.index

    @property
    def subnet(self) -> str:
        return f"10.77.{self.index}"

    @property
    def data_subnet(self) -> str:
        return f"10.78.{self.index}"

    @property
    def bridge(self) -> str:
        return f"dlhpc{self.tag}-br0"

    @property
    def data_bridge(self) -> str:
        """A second network ("the fabric", eth1 in each node) that can fail on its own."""
        return f"dlhpc{self.tag}-br1"

    @property
    def controller_address(self) -> str:
        return f"{self.subnet}.254"

    def netns(self, node: str) -> str:
        """The node's network namespace (``/run/netns/NAME``)."""
        return f"dlhpc{self.tag}-{node}"

    def veth(self, node: str, net: str = "control") -> str:
        """Host side of a node's link: ``control`` (eth0: Slurm, master) or ``data`` (eth1)."""
        if net not in ("control", "data"):
            raise LocalSlurmError(f"network {net!r}: expected 'control' or 'data'")
        return f"dlhpc{self.tag}{'-v' if net == 'control' else '-d'}{node}"[:15]


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
ClusterName={cfg.cluster_name}
SlurmctldHost={host}({cfg.controller_address})
SlurmctldPort={cfg.controller_port}
FirstJobId={cfg.first_job_id}
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
