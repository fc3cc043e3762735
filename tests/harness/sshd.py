"""Bare-metal hosts on this one machine: N network namespaces, each with its own sshd.

For tests and demos of ``dlrover-hpc launch``.  Each host gets a network namespace with a veth
on its own bridge (``dlhpc-sshbr``, hosts at ``10.79.0.N``, this machine at ``10.79.0.254``),
a UTS namespace (host name ``hostN``), a mount namespace (its own ``/etc/hosts`` naming every
host and this machine, its own ``/dev/shm``) and an IPC namespace; the file system is shared,
like a cluster file system.  sshd (Debian's openssh-server, installed when missing) accepts
only a throwaway client key; the known_hosts file and an OpenSSH client config that maps the
host names to their addresses are written next to it.  Needs root.

It never touches the local Slurm's bridges, namespaces or addresses (``dlhpc-br0``,
``dlhpc-nodeN``, 10.77/10.78)::

    with SshdCluster(SshdClusterConfig(hosts=3, state_dir=tmp)) as cluster:
        cluster.known_hosts, cluster.client_key, cluster.ssh_config
        cluster.cut_link("host2"); cluster.heal_link("host2")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.localslurm.commands import apt_install, node_argv, run_checked

SSHD = "/usr/sbin/sshd"


class SshdClusterError(DlroverHpcError):
    """The namespaces or their sshd could not be brought up or down."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SshdClusterConfig:
    state_dir: Path  # keys, configs and logs (the caller's; kept after down)
    hosts: int = 3
    prefix: str = "host"
    subnet: str = "10.79.0"
    bridge: str = "dlhpc-sshbr"
    #: The host side of each host's link is ``<veth_prefix><host>``: clusters side by side
    #: (test workers) need a bridge, a subnet and a prefix of their own.
    veth_prefix: str = "dlhpc-sv"
    shm_size: str = "1g"

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= 200:
            raise SshdClusterError(f"hosts={self.hosts}: expected 1 to 200")
        if not self.prefix.isidentifier() or len(self.prefix) > 5:
            raise SshdClusterError(f"prefix {self.prefix!r}: letters and digits, at most 5")
        if self.bridge in ("dlhpc-br0", "dlhpc-br1") or self.subnet.startswith(("10.77", "10.78")):
            raise SshdClusterError("the local Slurm's bridges and subnets are not for SSH hosts")

    def host_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.hosts + 1)]

    def address(self, host: str) -> str:
        return f"{self.subnet}.{int(host.removeprefix(self.prefix))}"

    @property
    def gateway(self) -> str:
        """This machine's address on the bridge (the launcher's, as the hosts see it)."""
        return f"{self.subnet}.254"

    def veth(self, host: str) -> str:
        return f"{self.veth_prefix}{host}"[:15]


def netns_name(host: str) -> str:
    return f"dlhpc-ssh-{host}"


def _run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 60.0) -> str:
    return run_checked(argv, error=SshdClusterError, check=check, timeout_s=timeout_s)


def ensure_openssh_server() -> None:
    """Install Debian's openssh-server when sshd is missing, without starting its service."""
    apt_install(["openssh-server"], present=(SSHD,), error=SshdClusterError)


class SshdCluster:
    """Bring the hosts up or down, look at their processes, cut and heal their links."""

    def __init__(self, config: SshdClusterConfig) -> None:
        self.config = config
        self.state_dir = config.state_dir
        self.client_key = self.state_dir / "id_ed25519"
        self.known_hosts = self.state_dir / "known_hosts"
        self.ssh_config = self.state_dir / "ssh_config"
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}

    def __enter__(self) -> SshdCluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def hosts(self) -> list[str]:
        return self.config.host_names()

    def address(self, host: str) -> str:
        return self.config.address(host)

    # -------------------------------------------------------------------- up
    def up(self, timeout_s: float = 30.0) -> float:
        """Start every host's sshd; returns the seconds it took."""
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise SshdClusterError("SSH hosts in network namespaces need root")
        ensure_openssh_server()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        try:
            self._write_keys_and_configs()
            self._setup_network()
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation
            for host in self.hosts:
                self._sshd[host] = self._start_sshd(host)
            self._wait_listening(timeout_s)
        except BaseException:
            self.down()
            raise
        return time.monotonic() - t0

    def _write_keys_and_configs(self) -> None:
        import asyncssh  # a dependency of the package; only needed here

        cfg = self.config
        client = asyncssh.generate_private_key("ssh-ed25519", comment="dlrover-hpc-test")
        client.write_private_key(str(self.client_key))
        os.chmod(self.client_key, 0o600)
        (self.state_dir / "authorized_keys").write_bytes(client.export_public_key())
        known, ssh_config = [], []
        for host in self.hosts:
            hdir = self.state_dir / host
            hdir.mkdir(exist_ok=True)
            key = asyncssh.generate_private_key("ssh-ed25519")
            key.write_private_key(str(hdir / "host_key"))
            os.chmod(hdir / "host_key", 0o600)
            public = key.export_public_key().decode().strip()
            (hdir / "host_key.pub").write_text(public + "\n")
            known.append(f"{host},{cfg.address(host)} {public}")
            ssh_config.append(f"Host {host}\n    HostName {cfg.address(host)}\n")
            (hdir / "sshd_config").write_text(self._sshd_config(host))
        self.known_hosts.write_text("\n".join(known) + "\n")
        self.ssh_config.write_text("".join(ssh_config))
        me = socket.gethostname().split(".")[0]
        hosts = ["127.0.0.1 localhost", f"{cfg.gateway} {me}"]
        hosts += [f"{cfg.address(h)} {h}" for h in self.hosts]
        (self.state_dir / "hosts").write_text("\n".join(hosts) + "\n")

    def _sshd_config(self, host: str) -> str:
        hdir = self.state_dir / host
        return f"""# written by harness.sshd for {host}
ListenAddress {self.config.address(host)}
Port 22
HostKey {hdir / "host_key"}
PidFile {hdir / "sshd.pid"}
AuthorizedKeysFile {self.state_dir / "authorized_keys"}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
PrintLastLog no
AcceptEnv LANG LC_*
MaxStartups 100:30:200
ClientAliveInterval 2
ClientAliveCountMax 3
LogLevel INFO
"""

    def _setup_network(self) -> None:
        cfg = self.config
        br = cfg.bridge
        if not Path(f"/sys/class/net/{br}").exists():
            _run(["ip", "link", "add", br, "type", "bridge"])
            _run(["ip", "addr", "add", f"{cfg.gateway}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        for host in self.hosts:
            ns, veth = netns_name(host), cfg.veth(host)
            if not Path(f"/run/netns/{ns}").exists():
                _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            if not Path(f"/sys/class/net/{veth}").exists():
                _run(
                    ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns]
                )
            _run(["ip", "link", "set", veth, "master", br, "up"])
            _run(["ip", "-n", ns, "addr", "replace", f"{cfg.address(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])

    def _start_sshd(self, host: str) -> subprocess.Popen[bytes]:
        hdir = self.state_dir / host
        argv = node_argv(
            netns=netns_name(host),
            hostname=host,
            hosts_file=str(self.state_dir / "hosts"),
            shm_size=self.config.shm_size,
            command=f"{SSHD} -D -e -f {hdir / 'sshd_config'}",
        )
        with open(hdir / "sshd.log", "ab") as logf:
            return subprocess.Popen(
                argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _wait_listening(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(self.hosts)
        while pending:
            for host in sorted(pending):
                proc = self._sshd[host]
                if proc.poll() is not None:
                    log = (self.state_dir / host / "sshd.log").read_text()[-1500:]
                    raise SshdClusterError(f"sshd of {host} exited ({proc.returncode}): {log}")
                if _banner(self.address(host)):
                    pending.discard(host)
            if pending and time.monotonic() > deadline:
                raise SshdClusterError(f"sshd did not answer within {timeout_s:.0f} s: {pending}")
            if pending:
                time.sleep(0.05)
        # Our probes count as startups in sshd's process title until it has seen them close;
        # wait for that, so a snapshot of the processes taken now stays valid.
        while any(_STARTUPS.search(_title(p.pid)) for p in self._sshd.values()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)

    # ------------------------------------------------------------------ down
    def down(self) -> None:
        """Stop everything in the namespaces, remove them, their links and the bridge."""
        for host in self.hosts:
            self._kill_all(host)
        for proc in self._sshd.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._sshd.clear()
        for host in self.hosts:
            if Path(f"/run/netns/{netns_name(host)}").exists():
                _run(["ip", "netns", "del", netns_name(host)], check=False)
            if Path(f"/sys/class/net/{self.config.veth(host)}").exists():
                _run(["ip", "link", "del", self.config.veth(host)], check=False)
        if Path(f"/sys/class/net/{self.config.bridge}").exists():
            _run(["ip", "link", "del", self.config.bridge], check=False)

    def _kill_all(self, host: str) -> None:
        procs = self._netns_processes(host)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)

    # ----------------------------------------------------------- inspection
    def _netns_processes(self, host: str) -> list[psutil.Process]:
        path = Path(f"/run/netns/{netns_name(host)}")
        if not path.exists():
            return []
        want = f"net:[{path.stat().st_ino}]"
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.readlink(f"/proc/{proc.pid}/ns/net") == want and proc.status() != "zombie":
                    found.append(proc)
        return found

    def processes(self, host: str) -> list[tuple[int, str]]:
        """(pid, command line) of every live process on ``host`` but its listening sshd."""
        daemon = self._sshd[host].pid if host in self._sshd else -1
        out = []
        for p in self._netns_processes(host):
            if p.pid == daemon:
                continue
            with contextlib.suppress(psutil.Error):
                out.append((p.pid, " ".join(p.cmdline())))
        return out

    def find(self, host: str, needle: str) -> list[int]:
        """PIDs of ``host``'s processes whose command line contains ``needle``."""
        return [pid for pid, cmd in self.processes(host) if needle in cmd]

    # ------------------------------------------------------- fault injection
    def cut_link(self, host: str) -> None:
        """Take the host's link down: nothing reaches it, it reaches nothing."""
        _run(["ip", "link", "set", self.config.veth(host), "down"])

    def heal_link(self, host: str) -> None:
        _run(["ip", "link", "set", self.config.veth(host), "up"])
        _run(["ip", "link", "set", self.config.veth(host), "master", self.config.bridge])

    def write_known_hosts(self, path: Path, hosts: Sequence[str]) -> Path:
        """A known_hosts file that trusts only ``hosts``."""
        keep = [ln for ln in self.known_hosts.read_text().splitlines() if ln.split(",")[0] in hosts]
        path.write_text("\n".join(keep) + "\n")
        return path


_STARTUPS = re.compile(r"\[listener\] [1-9][0-9]* of")


def _title(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def _banner(address: str) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=0.5) as sock:
            sock.settimeout(1.0)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False
