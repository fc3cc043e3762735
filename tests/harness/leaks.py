"""Snapshots of what a test may leak: child processes, network namespaces, /dev/shm entries.

``/dev/shm`` is checked on the host and inside every local-Slurm node (each has its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path

import psutil


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LeakSnapshot:
    children: frozenset[tuple[int, str]]
    netns: frozenset[str]
    shm: frozenset[str]
    node_processes: frozenset[tuple[int, str]]

    def leaked_since(self, before: LeakSnapshot) -> list[str]:
        out: list[str] = []
        for label, now, then in (
            ("child process", self.children, before.children),
            ("network namespace", self.netns, before.netns),
            ("shared-memory entry", self.shm, before.shm),
            ("process on a local-Slurm node", self.node_processes, before.node_processes),
        ):
            out += [f"{label}: {item}" for item in sorted(now - then, key=str)]
        return out


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:160]
    except psutil.Error:
        return "?"


def _alive(p: psutil.Process) -> bool:
    """Still running (not a zombie); a process that exits while we look is gone."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _node_roots(slurmd_pids: dict[str, int]) -> dict[str, Path]:
    return {n: Path(f"/proc/{pid}/root") for n, pid in slurmd_pids.items()}


def take_snapshot(*, slurmd_pids: dict[str, int] | None = None) -> LeakSnapshot:
    me = psutil.Process()
    daemons = set((slurmd_pids or {}).values())
    children = frozenset(
        (p.pid, _cmdline(p))
        for p in me.children(recursive=True)
        if p.pid not in daemons and _alive(p)
    )
    netns_dir = Path("/run/netns")
    netns = frozenset(os.listdir(netns_dir)) if netns_dir.exists() else frozenset()
    shm = {f"host:{name}" for name in os.listdir("/dev/shm")}
    node_procs: set[tuple[int, str]] = set()
    for node, root in _node_roots(slurmd_pids or {}).items():
        with contextlib.suppress(OSError):
            shm |= {f"{node}:{name}" for name in os.listdir(root / "dev/shm")}
        node_procs |= _node_processes(node, slurmd_pids[node])  # type: ignore[index]
    return LeakSnapshot(
        children=children, netns=netns, shm=frozenset(shm), node_processes=frozenset(node_procs)
    )


def _node_processes(node: str, slurmd_pid: int) -> set[tuple[int, str]]:
    """Processes sharing the node's network namespace, other than its slurmd."""
    try:
        ns = os.readlink(f"/proc/{slurmd_pid}/ns/net")
    except OSError:
        return set()
    found: set[tuple[int, str]] = set()
    for proc in psutil.process_iter():
        if proc.pid == slurmd_pid:
            continue
        try:
            if os.readlink(f"/proc/{proc.pid}/ns/net") == ns and proc.status() != "zombie":
                found.add((proc.pid, f"{node}: {_cmdline(proc)}"))
        except (OSError, psutil.Error):
            continue
    return found


def wait_no_leaks(
    before: LeakSnapshot, *, slurmd_pids: dict[str, int] | None = None, timeout_s: float = 15.0
) -> list[str]:
    """Leaks still present after ``timeout_s`` (processes may take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaked = take_snapshot(slurmd_pids=slurmd_pids).leaked_since(before)
        if not leaked or time.monotonic() >= deadline:
            return leaked
        time.sleep(0.2)
