"""A real multi-node Slurm on this one machine, for the demo, development and tests.

slurmctld and munged run in the root network namespace; each node gets a slurmd in its own
network namespace (a veth on a bridge, its own address), UTS namespace (its own host name),
mount namespace (its own /etc/hosts and /dev/shm) and IPC namespace.  The rest of the file
system is shared, like a cluster file system.  Needs root.

State lives in ``state_dir`` (``state.json``: what ``up`` started, so that ``down`` stops only
that).  Fault injection for tests: :meth:`LocalSlurm.kill_slurmd`, :meth:`LocalSlurm.kill_node`,
:meth:`LocalSlurm.cut_link`, :meth:`LocalSlurm.slow_link`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dlrover_hpc.errors import LocalSlurmError
from dlrover_hpc.testing.commands import node_argv, run_checked
from dlrover_hpc.testing.wait import wait_for

log = logging.getLogger(__name__)

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
SLURM_CONF = Path("/etc/slurm/slurm.conf")
TOPOLOGY_CONF = Path("/etc/slurm/topology.conf")
_MARK = "# written by dlrover-hpc local-slurm"


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


def netns_name(node: str) -> str:
    return f"dlhpc-{node}"


def _veth_host(node: str, net: str = "control") -> str:
    """Host side of a node's link: ``control`` (eth0: Slurm, master) or ``data`` (eth1)."""
    if net not in ("control", "data"):
        raise LocalSlurmError(f"network {net!r}: expected 'control' or 'data'")
    return (f"dlhpc-v{node}" if net == "control" else f"dlhpc-d{node}")[:15]


def _ifname(net: str) -> str:
    return "eth0" if net == "control" else "eth1"


def _run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 60.0) -> str:
    return run_checked(argv, error=LocalSlurmError, check=check, timeout_s=timeout_s)


def _alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (a killed daemon lingers as one for a moment)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait(
    predicate: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.1
) -> None:
    try:
        wait_for(predicate, timeout_s=timeout_s, what=what, interval_s=interval_s)
    except TimeoutError as exc:
        raise LocalSlurmError(str(exc)) from None


class LocalSlurm:
    """Bring a local multi-node Slurm up or down, inspect it and inject faults."""

    def __init__(self, config: LocalSlurmConfig | None = None) -> None:
        self.config = config or LocalSlurmConfig()
        self._state_file = self.config.state_dir / "state.json"

    # ----------------------------------------------------------------- state
    def _load_state(self) -> dict | None:
        try:
            return json.loads(self._state_file.read_text())
        except FileNotFoundError:
            return None

    def _save_state(self, state: dict) -> None:
        self.config.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self._state_file)

    def is_up(self) -> bool:
        state = self._load_state()
        return bool(state) and _alive(state.get("slurmctld_pid", -1))  # type: ignore[union-attr]

    # -------------------------------------------------------------------- up
    def up(self) -> float:
        """Start everything; returns the seconds it took.  Idempotent."""
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise LocalSlurmError(
                "local-slurm needs root (network namespaces, daemons, /etc/slurm); "
                "run it with sudo or as root"
            )
        state = self._load_state()
        if state and self.is_up():
            if state.get("nodes") == self.config.node_names() and all(
                _alive(p) for p in state.get("slurmd_pids", {}).values()
            ):
                log.info("local-slurm already up nodes=%d", self.config.nodes)
                return time.monotonic() - t0
            raise LocalSlurmError(
                f"a local Slurm with nodes {','.join(state.get('nodes', []))} is already up; "
                "run 'dlrover-hpc local-slurm down' first"
            )
        if state:  # left over from a crash: clean it first
            self.down()
        self._install_packages()
        state = {"nodes": self.config.node_names(), "slurmd_pids": {}, "created_conf": False}
        self._save_state(state)
        try:
            self._write_config(state)
            self._setup_network()
            state["munged_pid"] = self._start_munged()
            self._save_state(state)
            state["slurmctld_pid"] = self._start_slurmctld()
            self._save_state(state)
            for node in self.config.node_names():
                state["slurmd_pids"][node] = self._start_slurmd(node)
                self._save_state(state)
            self._wait_idle()
        except BaseException:
            log.error("local-slurm up failed; cleaning up what was started")
            self.down()
            raise
        took = time.monotonic() - t0
        log.info("local-slurm up nodes=%d seconds=%.2f", self.config.nodes, took)
        return took

    def _install_packages(self) -> None:
        missing = [p for p in ("slurmctld", "slurmd", "srun", "munged") if not shutil.which(p)]
        if not missing:
            return
        log.info("installing Slurm and munge from Debian packages missing=%s", missing)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
            proc = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
            if proc.returncode != 0:
                raise LocalSlurmError(
                    f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}; "
                    f"install the Debian packages {' '.join(PACKAGES)} by hand"
                )

    def _write_config(self, state: dict) -> None:
        cfg = self.config
        sd = cfg.state_dir
        for sub in ("ctld", "log", "spool"):
            (sd / sub).mkdir(parents=True, exist_ok=True)
        if SLURM_CONF.exists() and _MARK not in SLURM_CONF.read_text():
            raise LocalSlurmError(
                f"{SLURM_CONF} exists and was not written by dlrover-hpc; "
                "local-slurm will not overwrite a site's Slurm configuration"
            )
        host = socket.gethostname().split(".")[0]
        node_lines = [
            f"NodeName={n} NodeAddr={cfg.address(n)} NodeHostname={n} CPUs={cfg.cpus_per_node} "
            f"RealMemory={cfg.memory_mb_per_node} State=UNKNOWN"
            for n in cfg.node_names()
        ]
        hostlist = f"{cfg.prefix}[1-{cfg.nodes}]" if cfg.nodes > 1 else f"{cfg.prefix}1"
        conf = f"""{_MARK}; 'dlrover-hpc local-slurm down' removes it
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
        SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SLURM_CONF.write_text(conf)
        state["created_conf"] = True
        self._save_state(state)
        TOPOLOGY_CONF.write_text(self._topology_text())
        hosts = ["127.0.0.1 localhost", f"{cfg.controller_address} {host} slurmctld"]
        hosts += [f"{cfg.address(n)} {n}" for n in cfg.node_names()]
        (sd / "hosts").write_text("\n".join(hosts) + "\n")

    def _topology_text(self) -> str:
        if self.config.topology is not None:
            from dlrover_hpc import topology  # converts a switch list to topology.conf

            parsed = topology.load(self.config.topology)
            return topology.render(parsed, topology.TopologyFormat.SLURM, header=_MARK.lstrip("# "))
        # Default: two leaves of half the nodes each under one spine.
        names = self.config.node_names()
        half = max(1, len(names) // 2)
        leaves = [names[:half], names[half:]] if len(names) > 1 else [names]
        lines = [_MARK]
        for i, members in enumerate(leaves, 1):
            if members:
                lines.append(f"SwitchName=leaf{i} Nodes={','.join(members)}")
        lines.append(f"SwitchName=spine1 Switches=leaf[1-{len([m for m in leaves if m])}]")
        return "\n".join(lines) + "\n"

    def _setup_network(self) -> None:
        cfg = self.config
        nets = (("control", cfg.bridge, cfg.subnet), ("data", cfg.data_bridge, cfg.data_subnet))
        for _net, br, subnet in nets:
            if not Path(f"/sys/class/net/{br}").exists():
                _run(["ip", "link", "add", br, "type", "bridge"])
                _run(["ip", "addr", "add", f"{subnet}.254/24", "dev", br])
            _run(["ip", "link", "set", br, "up"])
        for node in cfg.node_names():
            ns = netns_name(node)
            if not Path(f"/run/netns/{ns}").exists():
                _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            index = cfg.address(node).rsplit(".", 1)[1]
            for net, br, subnet in nets:
                veth, ifname = _veth_host(node, net), _ifname(net)
                if not Path(f"/sys/class/net/{veth}").exists():
                    _run(
                        [
                            "ip",
                            "link",
                            "add",
                            veth,
                            "type",
                            "veth",
                            "peer",
                            "name",
                            ifname,
                            "netns",
                            ns,
                        ]
                    )
                _run(["ip", "link", "set", veth, "master", br, "up"])
                _run(["ip", "-n", ns, "addr", "replace", f"{subnet}.{index}/24", "dev", ifname])
                _run(["ip", "-n", ns, "link", "set", ifname, "up"])

    def _spawn(self, argv: Sequence[str], log_name: str) -> int:
        logf = open(self.config.state_dir / "log" / log_name, "ab")  # noqa: SIM115
        with logf:
            proc = subprocess.Popen(
                list(argv),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return proc.pid

    def _start_munged(self) -> int | None:
        sock = Path("/run/munge/munge.socket.2")
        if sock.exists() and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
            return None  # a munged that is not ours already answers; leave it alone
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        pid = self._spawn(["runuser", "-u", "munge", "--", "munged", "--foreground"], "munged.log")
        _wait(lambda: sock.exists(), timeout_s=10, what="munged's socket")
        return pid

    def _start_slurmctld(self) -> int:
        pid = self._spawn(["slurmctld", "-D", "-i"], "slurmctld.stdout")
        _wait(
            lambda: (
                subprocess.run(["scontrol", "ping"], capture_output=True).returncode == 0
                or not _alive(pid)
            ),
            timeout_s=20,
            what="slurmctld to answer 'scontrol ping'",
        )
        if not _alive(pid):
            raise LocalSlurmError(
                f"slurmctld exited at start; see {self.config.state_dir}/log/slurmctld.log"
            )
        return pid

    def _start_slurmd(self, node: str) -> int:
        sd = self.config.state_dir
        (sd / "spool" / node).mkdir(parents=True, exist_ok=True)
        argv = node_argv(
            netns=netns_name(node),
            hostname=node,
            hosts_file=f"{sd}/hosts",
            shm_size=self.config.shm_size,
            command=f"slurmd -D -N {node}",
        )
        return self._spawn(argv, f"slurmd-{node}.stdout")

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        want = set(self.config.node_names())

        def ready() -> bool:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True
            ).stdout
            idle = {ln.split()[0] for ln in out.splitlines() if ln.split()[1:] in (["idle"],)}
            return want <= idle

        _wait(ready, timeout_s=timeout_s, what=f"nodes {sorted(want)} to be idle", interval_s=0.2)

    # ------------------------------------------------------------------ down
    def down(self) -> float:
        """Stop the daemons ``up`` started, remove namespaces, bridge and our config."""
        t0 = time.monotonic()
        state = self._load_state() or {}
        nodes = state.get("nodes") or self.config.node_names()
        for node in nodes:
            self._kill_netns_processes(node)
        for pid in [*state.get("slurmd_pids", {}).values(), state.get("slurmctld_pid")]:
            if pid:
                self._terminate(pid)
        if state.get("munged_pid"):
            self._terminate(state["munged_pid"])
        for node in nodes:
            ns = netns_name(node)
            if Path(f"/run/netns/{ns}").exists():
                _run(["ip", "netns", "del", ns], check=False)
            for net in ("control", "data"):
                if Path(f"/sys/class/net/{_veth_host(node, net)}").exists():
                    _run(["ip", "link", "del", _veth_host(node, net)], check=False)
        for br in (self.config.bridge, self.config.data_bridge):
            if Path(f"/sys/class/net/{br}").exists():
                _run(["ip", "link", "del", br], check=False)
        for conf in (SLURM_CONF, TOPOLOGY_CONF):
            with contextlib.suppress(FileNotFoundError):
                if _MARK in conf.read_text():
                    conf.unlink()
        if self.config.state_dir.exists():
            shutil.rmtree(self.config.state_dir, ignore_errors=True)
        took = time.monotonic() - t0
        log.info("local-slurm down seconds=%.2f", took)
        return took

    def _terminate(self, pid: int, grace_s: float = 5.0) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _kill_netns_processes(self, node: str) -> list[int]:
        pids = self.netns_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait(lambda: not any(_alive(p) for p in pids), timeout_s=10, what=f"{node}'s processes")
        return pids

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        state = self._load_state()
        if not state:
            return {"up": False}
        sinfo = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=10
        ).stdout
        node_state = dict(ln.split()[:2] for ln in sinfo.splitlines() if len(ln.split()) >= 2)
        return {
            "up": self.is_up(),
            "slurmctld_pid": state.get("slurmctld_pid"),
            "nodes": [
                {
                    "name": n,
                    "address": self.config.address(n),
                    "netns": netns_name(n),
                    "slurmd_pid": state["slurmd_pids"].get(n),
                    "slurmd_alive": _alive(state["slurmd_pids"].get(n, -1)),
                    "state": node_state.get(n, "unknown"),
                }
                for n in state["nodes"]
            ],
        }

    # ------------------------------------------------------- fault injection
    def netns_pids(self, node: str) -> list[int]:
        ns = netns_name(node)
        if not Path(f"/run/netns/{ns}").exists():
            return []
        out = _run(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in out.split() if p.isdigit() and _alive(int(p))]

    def slurmd_pids(self) -> dict[str, int]:
        """Our live slurmd per node (empty when down)."""
        state = self._load_state() or {}
        return {n: int(p) for n, p in state.get("slurmd_pids", {}).items() if _alive(int(p))}

    def slurmd_pid(self, node: str) -> int:
        state = self._load_state() or {}
        pid = state.get("slurmd_pids", {}).get(node)
        if pid is None:
            raise LocalSlurmError(f"no slurmd of ours for node {node!r}")
        return int(pid)

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL the node's slurmd only (its job steps run on, as after a daemon crash)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.slurmd_pid(node), signal.SIGKILL)

    def kill_node(self, node: str, *, mark_down: bool = True) -> list[int]:
        """Kill every process in the node's namespaces, as if it lost power.

        With ``mark_down``, tell slurmctld at once (otherwise it notices after SlurmdTimeout).
        """
        pids = self._kill_netns_processes(node)
        if mark_down:
            _run(
                [
                    "scontrol",
                    "update",
                    f"nodename={node}",
                    "state=down",
                    "reason=dlrover-hpc test: node killed",
                ],
                check=False,
            )
        return pids

    def restart_node(self, node: str) -> None:
        """Start the node's slurmd again (after kill_node / kill_slurmd) and resume it."""
        state = self._load_state() or {}
        state.setdefault("slurmd_pids", {})[node] = self._start_slurmd(node)
        self._save_state(state)
        _run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)

    def cut_link(self, node: str, *, net: str = "control") -> None:
        """Take the node's link down: ``control`` (Slurm and the master lose it) or ``data``
        (only the fabric: the node still talks to the master but not to its peers' eth1)."""
        _run(["ip", "link", "set", _veth_host(node, net), "down"])

    def heal_link(self, node: str, *, net: str = "control") -> None:
        bridge = self.config.bridge if net == "control" else self.config.data_bridge
        _run(["ip", "link", "set", _veth_host(node, net), "up"])
        _run(["ip", "link", "set", _veth_host(node, net), "master", bridge])

    def slow_link(self, node: str, *, rate: str = "1mbit", net: str = "control") -> None:
        """Rate-limit the node's outgoing traffic (tbf; this kernel has no netem)."""
        _run(
            [
                "tc",
                "-n",
                netns_name(node),
                "qdisc",
                "replace",
                "dev",
                _ifname(net),
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "32kbit",
                "latency",
                "400ms",
            ]
        )

    def unslow_link(self, node: str, *, net: str = "control") -> None:
        _run(
            ["tc", "-n", netns_name(node), "qdisc", "del", "dev", _ifname(net), "root"], check=False
        )

    def node_exec_argv(self, node: str) -> list[str]:
        """argv prefix that runs a command inside the node's namespaces (net, uts, mount, ipc)."""
        return ["nsenter", "-t", str(self.slurmd_pid(node)), "--net", "--uts", "--mount", "--ipc"]
