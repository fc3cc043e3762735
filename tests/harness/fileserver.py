"""A real network file system for the local Slurm's nodes: a file server that stalls, fills,
goes read-only, dies and loses its link on demand.

The server runs in a network namespace of its own on the cluster's control bridge (address
``<subnet>.200``, veth ``dlhpc<N>-fs``: per cluster index, so test workers side by side never
meet).  What it exports lives on a size-limited tmpfs on this machine (``fill`` fills it,
``read_only`` remounts it read-only).  Every node mounts the export at one path in its own
mount namespace, so every node is a client of its own with its own TCP connection; the test
process sees the export itself (the tmpfs), never a client's view of it.

Two kinds:

- :class:`SshfsServer`: OpenSSH's ``sftp-server`` behind ``socat TCP-LISTEN:PORT,fork``, one
  ``sshfs -o directport=PORT,reconnect`` per node (FUSE).  Always available (Debian's
  packages are installed when missing).
- :class:`NfsServer`: nfs-ganesha (user space, VFS backend) and the kernel's NFS client,
  ``mount -t nfs -o vers=4.1,hard``; only where the kernel has an NFS client (``nfs`` in
  ``/proc/filesystems``), see :func:`nfs_available`.

Faults (each has its undo): :meth:`FileServer.stop` / :meth:`cont` (SIGSTOP / SIGCONT every
server process: a hung server, its TCP connections stay up), :meth:`fill` / :meth:`free`
(the export's file system full), :meth:`read_only` / :meth:`read_write`, :meth:`kill` /
:meth:`restart` (SIGKILL every server process: the clients' connections reset; a new server
on the same address), :meth:`cut_link` / :meth:`heal_link` (the server's veth down: no FIN,
no RST, a black hole)::

    with SshfsServer(cluster, FileServerConfig(state_dir=tmp, mount_point=mnt)) as fs:
        fs.export  # the directory the nodes see at mnt
        fs.stop(); ...; fs.cont()
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.localslurm import LocalSlurm
from dlrover_hpc.localslurm.commands import apt_install, run_checked

SFTP_SERVER = "/usr/lib/openssh/sftp-server"
GANESHA = "/usr/bin/ganesha.nfsd"

#: sshfs options that make it behave as much like a hard NFS mount as FUSE allows: a lost
#: connection is made again at the next request (``reconnect``), a hung server makes requests
#: wait (no ServerAlive timeout exists on a direct connection), and the nodes see each other's
#: writes at once: no cached directory listings, attributes or names (NFS's close-to-open).
SSHFS_OPTIONS = (
    "reconnect",
    "dir_cache=no",
    "attr_timeout=0",
    "entry_timeout=0",
    "negative_timeout=0",
)


class FileServerError(DlroverHpcError):
    """The file server or a node's mount could not be brought up, faulted or down."""


def _run(argv: Sequence[str], *, check: bool = True, timeout_s: float = 30.0) -> str:
    return run_checked(argv, error=FileServerError, check=check, timeout_s=timeout_s)


def nfs_available() -> bool:
    """Whether this kernel can mount NFS (it has a client for it)."""
    try:
        return any(
            line.split()[-1] in ("nfs", "nfs4")
            for line in Path("/proc/filesystems").read_text().splitlines()
            if line.strip()
        )
    except OSError:
        return False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FileServerConfig:
    state_dir: Path  # the export's tmpfs, logs and configs (the caller's)
    mount_point: Path  # where every node sees the export (an empty directory made here)
    size: str = "256m"  # the export's file system
    host: int = 200  # the server's address in the cluster's subnet
    port: int = 7022

    def __post_init__(self) -> None:
        if not 1 <= self.host <= 253:
            raise FileServerError(f"host={self.host}: expected an address 1..253 in the subnet")


class FileServer:
    """What every kind of server shares: its namespace, its link, the export and the faults.
    A kind says how to serve (:meth:`_serve`) and how a node mounts (:meth:`_mount`)."""

    kind = ""

    def __init__(self, cluster: LocalSlurm, config: FileServerConfig) -> None:
        self.cluster = cluster
        self.config = config
        cfg = cluster.config
        self.netns = f"dlhpc{cfg.tag}-fs"
        self.veth = f"dlhpc{cfg.tag}-fs"[:15]
        self.address = f"{cfg.subnet}.{config.host}"
        self.export = config.state_dir / "export"
        self.mount_point = config.mount_point
        self._filler = self.export / ".filler"
        self._server: subprocess.Popen[bytes] | None = None
        self._mounts: dict[str, subprocess.Popen[bytes]] = {}  # node -> its client (if a process)
        self._nodes: list[str] = []
        self._tmpfs = False

    def __enter__(self) -> FileServer:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -------------------------------------------------------------------- up
    def up(self, nodes: Sequence[str] | None = None, *, timeout_s: float = 30.0) -> float:
        """Serve the export and mount it on ``nodes`` (default: every node); the seconds."""
        t0 = time.monotonic()
        if os.geteuid() != 0:
            raise FileServerError("a file server in a network namespace needs root")
        self._install()
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True)
            self.export.mkdir(exist_ok=True)
            self.mount_point.mkdir(parents=True, exist_ok=True)
            options = f"size={self.config.size},mode=755"
            _run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(self.export)])
            self._tmpfs = True
            self._setup_network()
            self._server = self._serve()
            self._wait_listening(timeout_s)
            for node in nodes or self.cluster.config.node_names():
                self._nodes.append(node)
                self._mount(node, timeout_s)
        except BaseException:
            self.down()
            raise
        return time.monotonic() - t0

    def _install(self) -> None:
        raise NotImplementedError

    def _serve(self) -> subprocess.Popen[bytes]:
        raise NotImplementedError

    def _mount(self, node: str, timeout_s: float) -> None:
        raise NotImplementedError

    def _setup_network(self) -> None:
        cfg = self.cluster.config
        if not Path(f"/run/netns/{self.netns}").exists():
            _run(["ip", "netns", "add", self.netns])
        _run(["ip", "-n", self.netns, "link", "set", "lo", "up"])
        if not Path(f"/sys/class/net/{self.veth}").exists():
            # The same MAC address every time: a node's neighbour entry for the address, left
            # from the server before, stays right (else its connect times out on it).
            mac = f"02:00:0a:4d:{cfg.index:02x}:{self.config.host:02x}"
            peer = ["peer", "name", "eth0", "address", mac, "netns", self.netns]
            _run(["ip", "link", "add", self.veth, "type", "veth", *peer])
        _run(["ip", "link", "set", self.veth, "master", cfg.bridge, "up"])
        _run(["ip", "-n", self.netns, "addr", "replace", f"{self.address}/24", "dev", "eth0"])
        _run(["ip", "-n", self.netns, "link", "set", "eth0", "up"])

    def _in_netns(self, argv: Sequence[str]) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.netns}", *argv]

    def _spawn(self, argv: Sequence[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(self.config.state_dir / log_name, "ab") as logf:
            return subprocess.Popen(
                list(argv),
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _log(self, name: str) -> str:
        with contextlib.suppress(OSError):
            return (self.config.state_dir / name).read_text()[-1500:]
        return ""

    def _wait_listening(self, timeout_s: float) -> None:
        """Until the server accepts a connection (probed from inside its namespace)."""
        deadline = time.monotonic() + timeout_s
        probe = self._in_netns(["bash", "-c", f"exec 3<>/dev/tcp/127.0.0.1/{self.config.port}"])
        while subprocess.run(probe, capture_output=True, timeout=10).returncode != 0:
            if self._server is not None and self._server.poll() is not None:
                raise FileServerError(
                    f"the {self.kind} server exited ({self._server.returncode}): "
                    f"{self._log('server.log')}"
                )
            if time.monotonic() > deadline:
                raise FileServerError(f"the {self.kind} server did not listen in {timeout_s} s")
            time.sleep(0.05)

    def node_mounted(self, node: str) -> bool:
        """Whether the node's mount namespace has the export mounted at the mount point."""
        pid = self.cluster.slurmd_pid(node)
        try:
            lines = Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        except OSError:
            return False
        return any(ln.split()[4] == str(self.mount_point) for ln in lines)

    def node_exec(self, node: str, argv: Sequence[str], *, timeout_s: float = 30.0) -> str:
        """stdout of ``argv`` run in the node's namespaces (what its jobs see)."""
        return _run([*self.cluster.node_exec_argv(node), *argv], timeout_s=timeout_s)

    # ------------------------------------------------------------------ down
    def down(self) -> None:
        """Undo every fault, unmount on every node, stop the server, remove its namespace."""
        self._continue_all()
        with contextlib.suppress(FileServerError):
            self.heal_link()
        for node in list(self._nodes):
            self._unmount(node)
        self._nodes.clear()
        self._kill_server()
        if Path(f"/run/netns/{self.netns}").exists():
            _run(["ip", "netns", "del", self.netns], check=False)
        if Path(f"/sys/class/net/{self.veth}").exists():
            _run(["ip", "link", "del", self.veth], check=False)
        if self._tmpfs:
            _run(["umount", "-l", str(self.export)], check=False)
            self._tmpfs = False

    def _unmount(self, node: str) -> None:
        try:
            enter = self.cluster.node_exec_argv(node)
        except DlroverHpcError:
            enter = None  # the node is gone, and its mount namespace with it
        if enter is not None and self.node_mounted(node):
            for argv in self._unmount_argvs():
                _run([*enter, *argv], check=False, timeout_s=20)
                if not self.node_mounted(node):
                    break
        client = self._mounts.pop(node, None)
        if client is not None:
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(timeout=10)

    def _unmount_argvs(self) -> list[list[str]]:
        return [["umount", str(self.mount_point)], ["umount", "-l", str(self.mount_point)]]

    # ----------------------------------------------------------- the server
    def server_pids(self) -> list[int]:
        """Every live process in the server's namespace (the server and its children)."""
        path = Path(f"/run/netns/{self.netns}")
        if not path.exists():
            return []
        want = f"net:[{path.stat().st_ino}]"
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.readlink(f"/proc/{proc.pid}/ns/net") == want and proc.status() != "zombie":
                    found.append(proc.pid)
        return found

    def _signal_all(self, sig: signal.Signals) -> list[int]:
        pids = self.server_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def _continue_all(self) -> None:
        self._signal_all(signal.SIGCONT)

    def _kill_server(self) -> None:
        pids = self._signal_all(signal.SIGKILL)
        if self._server is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._server.wait(timeout=10)
            self._server = None
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        psutil.wait_procs(procs, timeout=10)

    # ------------------------------------------------------- fault injection
    def stop(self) -> None:
        """SIGSTOP every server process: it answers nothing, its connections stay up."""
        self._signal_all(signal.SIGSTOP)

    def cont(self) -> None:
        self._continue_all()

    def kill(self) -> None:
        """SIGKILL every server process: the clients' connections are reset."""
        self._kill_server()

    def restart(self, timeout_s: float = 30.0) -> None:
        """A new server on the same address and export (after :meth:`kill`)."""
        self._server = self._serve()
        self._wait_listening(timeout_s)

    def fill(self) -> int:
        """Fill the export's file system to the last byte; the bytes it took."""
        written, chunk = 0, b"\0" * (1 << 20)
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while True:
                try:
                    n = os.write(fd, chunk if written < 1 << 34 else b"")
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(chunk) == 1:
                        return written
                    chunk = chunk[: len(chunk) // 2]  # the last pages, byte-exact
                    continue
                if n == 0:
                    raise FileServerError(f"{self.export} never filled up")
                written += n
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)

    def read_only(self, timeout_s: float = 30.0) -> None:
        """Remount the export read-only (retried while a file is open for writing: a
        persist between two files is the moment it succeeds)."""
        self._remount("ro", timeout_s)

    def read_write(self, timeout_s: float = 30.0) -> None:
        self._remount("rw", timeout_s)

    def _remount(self, mode: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        argv = ["mount", "-o", f"remount,{mode}", str(self.export)]
        while True:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise FileServerError(f"{' '.join(argv)}: {proc.stderr.strip()}")
            time.sleep(0.01)

    def cut_link(self) -> None:
        """The server's veth down: nothing reaches it, it reaches nothing (no FIN, no RST)."""
        _run(["ip", "link", "set", self.veth, "down"])

    def heal_link(self) -> None:
        if not Path(f"/sys/class/net/{self.veth}").exists():
            return
        _run(["ip", "link", "set", self.veth, "up"])
        _run(["ip", "link", "set", self.veth, "master", self.cluster.config.bridge])


class SshfsServer(FileServer):
    """OpenSSH's sftp-server behind socat; every node an sshfs client (FUSE)."""

    kind = "sshfs"

    def _install(self) -> None:
        apt_install(
            ["sshfs", "socat", "openssh-sftp-server"],
            present=("sshfs", "socat", SFTP_SERVER),
            error=FileServerError,
            recommends=False,
        )

    def _serve(self) -> subprocess.Popen[bytes]:
        port = self.config.port
        listen = f"TCP-LISTEN:{port},fork,reuseaddr"
        # nofork: the connection's socket is sftp-server's stdin and stdout (no relay process)
        return self._spawn(
            self._in_netns(["socat", listen, f"EXEC:{SFTP_SERVER},nofork"]), "server.log"
        )

    def _mount(self, node: str, timeout_s: float) -> None:
        options = ",".join([f"directport={self.config.port}", *SSHFS_OPTIONS])
        argv = [
            *self.cluster.node_exec_argv(node),
            "sshfs",
            "-f",  # in the foreground: the process is ours, by PID
            "-o",
            options,
            f"{self.address}:{self.export}",
            str(self.mount_point),
        ]
        self.node_exec(node, ["ip", "neigh", "flush", "to", self.address])
        self._mounts[node] = client = self._spawn(argv, f"sshfs-{node}.log")
        deadline = time.monotonic() + timeout_s
        while not self.node_mounted(node):
            if client.poll() is not None:
                log = self._log(f"sshfs-{node}.log")
                raise FileServerError(f"sshfs on {node} exited ({client.returncode}): {log}")
            if time.monotonic() > deadline:
                raise FileServerError(f"sshfs on {node} did not mount in {timeout_s} s")
            time.sleep(0.05)
        self.node_exec(node, ["stat", "-f", str(self.mount_point)])  # a round trip: it answers

    def _unmount_argvs(self) -> list[list[str]]:
        mnt = str(self.mount_point)
        return [["fusermount", "-u", mnt], ["fusermount", "-uz", mnt], ["umount", "-l", mnt]]


class NfsServer(FileServer):
    """nfs-ganesha (user space, VFS backend) exporting the tmpfs; every node mounts it with the
    kernel's NFS client (hard, NFSv4.1).  Only where the kernel has an NFS client."""

    kind = "nfs"

    def _install(self) -> None:
        if not nfs_available():
            raise FileServerError("this kernel has no NFS client (no nfs in /proc/filesystems)")
        apt_install(
            ["nfs-ganesha", "nfs-ganesha-vfs", "nfs-common"],
            present=(GANESHA, "mount.nfs"),
            error=FileServerError,
            recommends=False,
        )

    def _serve(self) -> subprocess.Popen[bytes]:
        conf = self.config.state_dir / "ganesha.conf"
        conf.write_text(
            f"""NFS_CORE_PARAM {{ NFS_Port = {self.config.port}; Protocols = 4; }}
NFSV4 {{ Graceless = true; Lease_Lifetime = 10; Grace_Period = 10; }}
EXPORT {{
    Export_Id = 1; Path = {self.export}; Pseudo = /export; Protocols = 4;
    Access_Type = RW; Squash = No_Root_Squash; SecType = sys;
    FSAL {{ Name = VFS; }}
}}
"""
        )
        argv = ["ganesha.nfsd", "-F", "-f", str(conf), "-L", "STDOUT"]
        argv += ["-p", str(self.config.state_dir / "ganesha.pid")]
        return self._spawn(self._in_netns(argv), "server.log")

    def _mount(self, node: str, timeout_s: float) -> None:
        options = f"vers=4.1,proto=tcp,port={self.config.port},hard,timeo=50,retrans=2"
        argv = ["mount", "-t", "nfs", "-o", options, f"{self.address}:/export"]
        self.node_exec(node, [*argv, str(self.mount_point)], timeout_s=timeout_s)
