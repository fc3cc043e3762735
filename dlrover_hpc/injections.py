"""What ``dlrover-run`` puts into a worker beyond torchrun's environment, each with its own off
switch (issue 45), and ``--transparent`` for all of them.

A switch is the flag ``--no-<name>``, the TOML key ``no_<name>`` of ``[run]`` and its environment
variable (1/true/yes/on), declared in :mod:`dlrover_hpc.settings`. The agent passes the ones that
are off to its workers under the same variable names, so the code that runs inside a worker (the
hooks, the signal mask, the in-process wrapper) reads one name. With every one off a worker is what
torchrun starts: ``python -u script.py`` with torchrun's variables (and dlrover-hpc's, which only
its own API reads); crash recovery, flash checkpoints and the master work as before, and hang
detection falls back to explicit progress (:func:`dlrover_hpc.progress.step`, checkpoint saves).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping

from dlrover_hpc import settings
from dlrover_hpc.settings import Setting


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    name: str  # its off switch is the setting no_<name>
    setting: Setting[bool]  # the off switch: its flag, variable and help

    @property
    def flag(self) -> str:
        return self.setting.flag

    @property
    def key(self) -> str:
        return self.setting.key

    @property
    def env(self) -> str:
        return self.setting.env


PREWARM = Injection(name="prewarm", setting=settings.NO_PREWARM)
WORKER_HOOKS = Injection(name="worker_hooks", setting=settings.NO_WORKER_HOOKS)
USR1_HOLD = Injection(name="usr1_hold", setting=settings.NO_USR1_HOLD)
SLURM_ENV_REWRITE = Injection(name="slurm_env_rewrite", setting=settings.NO_SLURM_ENV_REWRITE)
GC_HANDLING = Injection(name="gc_handling", setting=settings.NO_GC_HANDLING)
ALL = (PREWARM, WORKER_HOOKS, USR1_HOLD, SLURM_ENV_REWRITE, GC_HANDLING)
BY_NAME = {i.name: i for i in ALL}
TRANSPARENT_ENV = settings.TRANSPARENT.env
_TRUE = frozenset({"1", "true", "yes", "on"})


def enabled(injection: Injection, env: Mapping[str, str] | None = None) -> bool:
    """Inside a worker: whether the agent (or the user's environment) left it on."""
    env = os.environ if env is None else env
    return env.get(injection.env, "").strip().lower() not in _TRUE


def worker_env(off: Iterable[str]) -> dict[str, str]:
    """The variables that tell a worker which injections are off (names of :data:`ALL`)."""
    return {BY_NAME[name].env: "1" for name in off}
