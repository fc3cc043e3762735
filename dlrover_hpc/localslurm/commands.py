"""Running the system commands (ip, tc, apt-get...) that the test clusters are built with."""

from __future__ import annotations

import contextlib
import fcntl
import shlex
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

#: Held while packages are installed: test workers side by side install Slurm, sshd or
#: Prometheus at the same moment, and dpkg takes one installer at a time.
APT_LOCK = Path("/var/lib/dlrover-hpc/apt.lock")
_POLICY_RC = Path("/usr/sbin/policy-rc.d")


def run_checked(
    argv: Sequence[str],
    *,
    error: type[Exception],
    check: bool = True,
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> str:
    """stdout of ``argv``; ``error`` with the command and its stderr when it fails."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False, env=env
        )
    except FileNotFoundError as exc:
        raise error(f"{argv[0]}: command not found ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise error(f"{shlex.join(argv)}: no answer within {timeout_s:.0f} s") from exc
    if check and proc.returncode != 0:
        raise error(
            f"{shlex.join(argv)} failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout


def node_argv(
    *, netns: str, hostname: str, hosts_file: str, shm_size: str, command: str
) -> list[str]:
    """argv that runs the shell ``command`` as a node of a test cluster: in the network
    namespace ``netns``, with private UTS, mount and IPC namespaces holding its own host name,
    ``/etc/hosts`` (bind-mounted ``hosts_file``) and ``/dev/shm``.

    nsenter + unshare rather than ``ip netns exec``: the latter remounts /sys, which hides
    /sys/fs/cgroup, and slurmd then refuses to start.
    """
    setup = (
        f"hostname {hostname} && mount --bind {hosts_file} /etc/hosts && "
        f"mount -t tmpfs -o size={shm_size},mode=1777 tmpfs /dev/shm && exec {command}"
    )
    return [
        "nsenter",
        f"--net=/run/netns/{netns}",
        "unshare",
        "--uts",
        "--mount",
        "--ipc",
        "--propagation",
        "private",
        "sh",
        "-c",
        setup,
    ]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its directory) for the block:
    one test worker at a time in it, whichever process of which worker asks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def apt_install(
    packages: Sequence[str],
    *,
    present: Sequence[str],
    error: type[Exception],
    recommends: bool = True,
    timeout_s: float = 600.0,
) -> bool:
    """Install Debian's ``packages`` unless every path or command in ``present`` exists;
    True if it installed them.

    One installer at a time (a lock file: test workers side by side ask at once); the one that
    waited finds the packages there.  A ``policy-rc.d`` that denies every action (unless one
    is already there) keeps the packages' maintainer scripts from starting their services.
    """

    def missing() -> bool:
        return not all(Path(p).exists() if "/" in p else shutil.which(p) for p in present)

    if not missing():
        return False
    with file_lock(APT_LOCK):
        if not missing():
            return False
        ours = not _POLICY_RC.exists()
        if ours:  # Debian's way to keep a package's postinst from starting the daemon
            _POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
            _POLICY_RC.chmod(0o755)
        extra = [] if recommends else ["--no-install-recommends"]
        apt = ["env", "DEBIAN_FRONTEND=noninteractive", "apt-get", "-qq"]
        apt += ["-o", f"DPkg::Lock::Timeout={int(timeout_s)}"]  # another apt may be running
        try:
            for argv in (
                [*apt, "update"],
                [*apt, "install", "-y", *extra, *packages],
            ):
                try:
                    run_checked(argv, error=error, timeout_s=timeout_s)
                except error as exc:
                    raise error(
                        f"{exc}; install the Debian packages {' '.join(packages)} by hand"
                    ) from None
        finally:
            if ours:
                _POLICY_RC.unlink(missing_ok=True)
    return True
