"""A real multi-node Slurm on this one machine, for the demo, development and tests.

slurmctld and munged run in the root network namespace; each node gets a slurmd in its own
network namespace (a veth on a bridge, its own address), UTS namespace (its own host name),
mount namespace (its own /etc/hosts and /dev/shm) and IPC namespace.  The rest of the file
system is shared, like a cluster file system.  Needs root.

State lives in ``state_dir`` (``state.json``: what ``up`` started, so that ``down`` stops only
that).  Fault injection for tests: :meth:`LocalSlurm.kill_slurmd`, :meth:`LocalSlurm.kill_node`,
:meth:`LocalSlurm.cut_link`, :meth:`LocalSlurm.slow_link`.

This module runs the cluster's life cycle; the configuration and its files are in
``slurm_config``, the networks and link faults in ``slurm_net``, process handling in
``slurm_procs``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from dlrover_hpc.errors import LocalSlurmError
from dlrover_hpc.localslurm import slurm_net
from dlrover_hpc.localslurm.commands import file_lock, node_argv
from dlrover_hpc.localslurm.slurm_config import (
    BASE_DIR,
    MARK,
    LocalSlurmConfig,
    hosts_text,
    slurm_conf_text,
    topology_text,
)
from dlrover_hpc.localslurm.slurm_procs import alive, install_packages, run, spawn, terminate, wait

__all__ = ["LocalSlurm", "LocalSlurmConfig"]

log = logging.getLogger(__name__)


class LocalSlurm:
    """Bring a local multi-node Slurm up or down, inspect it and inject faults."""

    def __init__(self, config: LocalSlurmConfig | None = None) -> None:
        self.config = config or LocalSlurmConfig()
        self._state_file = self.config.state_dir / "state.json"
        #: The environment of the Slurm commands and daemons: ``SLURM_CONF`` names this
        #: cluster's configuration (export it to talk to cluster N from a shell).
        self.env = {**os.environ, "SLURM_CONF": str(self.config.slurm_conf)}

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
        return bool(state) and alive(state.get("slurmctld_pid", -1))  # type: ignore[union-attr]

    # -------------------------------------------------------------------- up
    def up(self, say: Callable[[str], None] | None = None) -> float:
        """Start everything; returns the seconds it took.  Idempotent.  ``say`` hears each
        stage as it starts (the command line shows it: installing Slurm takes a while)."""
        say = say or (lambda _: None)
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise LocalSlurmError(
                "local-slurm needs root (network namespaces, daemons, /etc/slurm); "
                "run it with sudo or as root"
            )
        state = self._load_state()
        if state and self.is_up():
            if state.get("nodes") == self.config.node_names() and all(
                alive(p) for p in state.get("slurmd_pids", {}).values()
            ):
                log.info("local-slurm already up nodes=%d", self.config.nodes)
                return time.monotonic() - t0
            raise LocalSlurmError(
                f"a local Slurm with nodes {','.join(state.get('nodes', []))} is already up; "
                "run 'dlrover-hpc local-slurm down' first"
            )
        if state:  # left over from a crash: clean it first
            self.down()
        say("installing Slurm and munge if missing (apt-get)")
        install_packages()
        state = {
            "nodes": self.config.node_names(),
            "slurmd_pids": {},
            "created_conf": False,
            "starter_pid": os.getpid(),  # a cluster coming up counts as up (munged stays)
        }
        self._save_state(state)
        try:
            self._write_config(state)
            say(f"network namespaces for {self.config.nodes} nodes")
            slurm_net.setup_network(self.config)
            say("munged, slurmctld")
            self._start_munged()
            state["slurmctld_pid"] = self._start_slurmctld()
            self._save_state(state)
            for i, node in enumerate(self.config.node_names(), 1):
                say(f"slurmd {i}/{self.config.nodes} ({node})")
                state["slurmd_pids"][node] = self._start_slurmd(node)
                self._save_state(state)
            say("waiting for the nodes to be idle")
            self._wait_idle()
        except BaseException:
            log.error("local-slurm up failed; cleaning up what was started")
            self.down()
            raise
        took = time.monotonic() - t0
        log.info("local-slurm up nodes=%d seconds=%.2f", self.config.nodes, took)
        return took

    def _write_config(self, state: dict) -> None:
        cfg = self.config
        sd = cfg.state_dir
        for sub in ("ctld", "log", "spool"):
            (sd / sub).mkdir(parents=True, exist_ok=True)
        if cfg.slurm_conf.exists() and MARK not in cfg.slurm_conf.read_text():
            raise LocalSlurmError(
                f"{cfg.slurm_conf} exists and was not written by dlrover-hpc; "
                "local-slurm will not overwrite a site's Slurm configuration"
            )
        host = socket.gethostname().split(".")[0]
        conf = slurm_conf_text(cfg, host=host)
        cfg.slurm_conf.parent.mkdir(parents=True, exist_ok=True)
        cfg.slurm_conf.write_text(conf)
        state["created_conf"] = True
        self._save_state(state)
        cfg.topology_conf.write_text(topology_text(cfg))
        (sd / "hosts").write_text(hosts_text(cfg, host=host))

    def _spawn(self, argv: list[str], log_name: str) -> int:
        return spawn(argv, self.config.state_dir / "log" / log_name, env=self.env)

    def _run(self, argv: list[str], *, check: bool = True) -> str:
        """A Slurm command of this cluster's."""
        return run(argv, check=check, env=self.env)

    def _answers(self, argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, env=self.env)

    def _start_munged(self) -> None:
        """One munged for every local cluster: the first one up starts it (under a lock: test
        workers bring theirs up side by side), the last one down stops it (:meth:`down`)."""
        sock = Path("/run/munge/munge.socket.2")
        with file_lock(MUNGED_LOCK):
            if (
                sock.exists()
                and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0
            ):
                return  # a munged already answers (another cluster's, or not ours)
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            argv = ["runuser", "-u", "munge", "--", "munged", "--foreground"]
            pid = spawn(argv, BASE_DIR / "munged.log", env=self.env)
            wait(lambda: sock.exists(), timeout_s=10, what="munged's socket")
            MUNGED_PID.write_text(str(pid))

    def _stop_munged(self) -> None:
        """Stop the munged a local cluster started, unless another cluster still runs."""
        with file_lock(MUNGED_LOCK):
            try:
                pid = int(MUNGED_PID.read_text())
            except (FileNotFoundError, ValueError):
                return
            if other_clusters_up(self.config.state_dir):
                return
            terminate(pid)
            MUNGED_PID.unlink(missing_ok=True)

    def _start_slurmctld(self) -> int:
        pid = self._spawn(
            ["slurmctld", "-D", "-i", "-f", str(self.config.slurm_conf)], "slurmctld.stdout"
        )
        wait(
            lambda: self._answers(["scontrol", "ping"]).returncode == 0 or not alive(pid),
            timeout_s=20,
            what="slurmctld to answer 'scontrol ping'",
        )
        if not alive(pid):
            raise LocalSlurmError(
                f"slurmctld exited at start; see {self.config.state_dir}/log/slurmctld.log"
            )
        return pid

    def _start_slurmd(self, node: str) -> int:
        sd = self.config.state_dir
        (sd / "spool" / node).mkdir(parents=True, exist_ok=True)
        argv = node_argv(
            netns=self.config.netns(node),
            hostname=node,
            hosts_file=f"{sd}/hosts",
            shm_size=self.config.shm_size,
            command=f"slurmd -D -N {node} -f {self.config.slurm_conf}",
        )
        return self._spawn(argv, f"slurmd-{node}.stdout")

    def _wait_idle(self, timeout_s: float = 60.0) -> None:
        want = set(self.config.node_names())

        def ready() -> bool:
            out = self._answers(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
            idle = {ln.split()[0] for ln in out.splitlines() if ln.split()[1:] in (["idle"],)}
            return want <= idle

        wait(ready, timeout_s=timeout_s, what=f"nodes {sorted(want)} to be idle", interval_s=0.2)

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
                terminate(pid)
        self._stop_munged()  # the last local cluster down stops it
        slurm_net.remove_network(self.config, nodes)
        for conf in (self.config.slurm_conf, self.config.topology_conf):
            with contextlib.suppress(FileNotFoundError):
                if MARK in conf.read_text():
                    conf.unlink()
        if self.config.state_dir.exists():
            shutil.rmtree(self.config.state_dir, ignore_errors=True)
        took = time.monotonic() - t0
        log.info("local-slurm down seconds=%.2f", took)
        return took

    def _kill_netns_processes(self, node: str) -> list[int]:
        pids = self.netns_pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait(lambda: not any(alive(p) for p in pids), timeout_s=10, what=f"{node}'s processes")
        return pids

    # ---------------------------------------------------------------- status
    def status(self) -> dict:
        state = self._load_state()
        if not state:
            return {"up": False}
        sinfo = self._answers(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
        node_state = dict(ln.split()[:2] for ln in sinfo.splitlines() if len(ln.split()) >= 2)
        return {
            "up": self.is_up(),
            "slurmctld_pid": state.get("slurmctld_pid"),
            "nodes": [
                {
                    "name": n,
                    "address": self.config.address(n),
                    "netns": self.config.netns(n),
                    "slurmd_pid": state["slurmd_pids"].get(n),
                    "slurmd_alive": alive(state["slurmd_pids"].get(n, -1)),
                    "state": node_state.get(n, "unknown"),
                }
                for n in state["nodes"]
            ],
        }

    # ------------------------------------------------------- fault injection
    def netns_pids(self, node: str) -> list[int]:
        """Live processes in the node's network namespace."""
        return slurm_net.netns_pids(self.config, node)

    def slurmd_pids(self) -> dict[str, int]:
        """Our live slurmd per node (empty when down)."""
        state = self._load_state() or {}
        return {n: int(p) for n, p in state.get("slurmd_pids", {}).items() if alive(int(p))}

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
            self._run(
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
        self._run(["scontrol", "update", f"nodename={node}", "state=resume"], check=False)

    def cut_link(self, node: str, *, net: str = "control") -> None:
        """Take the node's link down: ``control`` (Slurm and the master lose it) or ``data``
        (only the fabric: the node still talks to the master but not to its peers' eth1)."""
        slurm_net.cut_link(self.config, node, net=net)

    def heal_link(self, node: str, *, net: str = "control") -> None:
        slurm_net.heal_link(self.config, node, net=net)

    def slow_link(self, node: str, *, rate: str = "1mbit", net: str = "control") -> None:
        """Rate-limit the node's outgoing traffic (tbf; this kernel has no netem)."""
        slurm_net.slow_link(self.config, node, rate=rate, net=net)

    def unslow_link(self, node: str, *, net: str = "control") -> None:
        slurm_net.unslow_link(self.config, node, net=net)

    def node_exec_argv(self, node: str) -> list[str]:
        """argv prefix that runs a command inside the node's namespaces (net, uts, mount, ipc)."""
        return ["nsenter", "-t", str(self.slurmd_pid(node)), "--net", "--uts", "--mount", "--ipc"]


MUNGED_PID = BASE_DIR / "munged.pid"

MUNGED_LOCK = BASE_DIR / "munged.lock"


def other_clusters_up(state_dir: Path) -> list[Path]:
    """State directories of the other local clusters whose slurmctld still runs."""
    up = []
    for state_file in BASE_DIR.glob("local-slurm*/state.json"):
        if state_file.parent == state_dir:
            continue
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(state_file.read_text())
            ctld, starter = state.get("slurmctld_pid"), state.get("starter_pid")
            if alive(int(ctld or -1)) or (not ctld and alive(int(starter or -1))):
                up.append(state_file.parent)
    return up
