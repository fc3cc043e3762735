"""A test worker of its own: several test processes side by side on one machine, each with
its own local Slurm, must not see each other's ``/dev/shm`` entries or network namespaces.

:func:`private_mounts` moves the calling process into a new mount namespace and mounts a fresh
tmpfs on each of ``/dev/shm`` and ``/run/netns``.  The rest of the file system stays shared.
What the process starts afterwards inherits the view: its workers' shared-memory segments and
``ip netns add`` of its own cluster's nodes are seen by it alone, so its leak checks and its
cleanup count only what its own tests made.  Bridges, links and addresses live in the network
namespace, not here: each cluster names its own (:class:`LocalSlurmConfig` ``index``).
"""

from __future__ import annotations

import ctypes
import os
import subprocess

from dlrover_hpc.errors import DlroverHpcError

_CLONE_NEWNS = 0x00020000


def worker_index() -> int:
    """0 for a test run alone; worker ``gwK`` of ``pytest -n N`` is K+1 (its local Slurm's
    cluster index, and what its SSH hosts' names carry)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker.removeprefix("gw")) + 1 if worker.startswith("gw") else 0


#: Each private path and the mode of its tmpfs.
PRIVATE = {"/dev/shm": "1777", "/run/netns": "755"}


def private_mounts(paths: dict[str, str] = PRIVATE, *, size: str = "8g") -> None:
    """Give this process (and what it starts from now on) private tmpfs mounts at ``paths``.

    Needs root.  Only the calling thread moves (``unshare(2)`` with ``CLONE_NEWNS``): call it
    from the thread that runs the tests, before it starts anything.  Every mount of the new
    namespace is made private first, so nothing mounted here reaches the machine's namespace.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise DlroverHpcError(f"unshare(CLONE_NEWNS) failed: {os.strerror(err)}; needs root")
    _mount(["--make-rprivate", "/"])
    for path, mode in paths.items():
        os.makedirs(path, exist_ok=True)
        _mount(["-t", "tmpfs", "-o", f"size={size},mode={mode}", "tmpfs", path])


def _mount(args: list[str]) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise DlroverHpcError(f"mount {' '.join(args)} failed: {proc.stderr.strip()}")
