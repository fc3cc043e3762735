"""Torch ranks for tests, forked from one pre-warmed interpreter instead of each importing torch.

A test that starts torch ranks of its own (a two-rank checkpoint exchange, a gloo world that
shrinks) spends most of each rank's CPU on ``import torch``; on a 2-core machine running tests
side by side, that CPU is the suite's time.  :class:`WarmPython` keeps the agent's own zygote
(:mod:`dlrover_hpc.agent.zygote`) for the whole test session and gives the command line that
runs ``python SCRIPT ARGS...`` as one of its forks: the rank still gets its own environment,
working directory, standard streams, process and exit status (or signal), exactly as a worker
of ``dlrover-run`` does.  The zygote is single-threaded and never runs torch code, so a fork
inherits no thread or lock of a parent.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

from dlrover_hpc.agent.zygote import Zygote


class WarmPython:
    """``warm([script, *args])``: the command line of a fork that runs the script.

    :meth:`start` the zygote from the thread that outlives its use (it dies with that thread)
    and :meth:`close` it at the end; :meth:`of` its socket gives the command lines to another
    process (a fork's client dies with the process that made its command line)."""

    def __init__(self, socket_path: str, *, owner: bool = False, ready_s: float = 120) -> None:
        self.socket_path = socket_path
        self._zygote = Zygote(socket_path)
        self._owner, self._ready_s = owner, ready_s

    @classmethod
    def start(cls, socket_path: str, env: Mapping[str, str], *, ready_s: float = 120) -> WarmPython:
        warm = cls(socket_path, owner=True, ready_s=ready_s)
        warm._zygote.start(dict(env))
        return warm

    @classmethod
    def of(cls, socket_path: str) -> WarmPython:
        """Command lines for a zygote that another process started (and waited for)."""
        return cls(socket_path)

    def __call__(self, argv: Sequence[str]) -> list[str]:
        if self._owner and not self._zygote.ready(self._ready_s):
            raise RuntimeError(f"the pre-warmed interpreter did not start in {self._ready_s} s")
        return [sys.executable, *self._zygote.client_args(list(argv), module=False)]

    def close(self) -> None:
        if self._owner:
            self._zygote.stop()
