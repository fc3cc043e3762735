"""Running the system commands (ip, tc, apt-get...) that the test clusters are built with."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence


def run_checked(
    argv: Sequence[str],
    *,
    error: type[Exception],
    check: bool = True,
    timeout_s: float = 60.0,
) -> str:
    """stdout of ``argv``; ``error`` with the command and its stderr when it fails."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
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
