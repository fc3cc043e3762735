"""What ``dlrover-run`` puts into a worker beyond torchrun's environment, each with its own off
switch (issue 45), and ``--transparent`` for all of them.

A switch is the flag ``--no-<name>``, the TOML key ``no_<name>`` of ``[run]`` and the environment
variable ``DLROVER_HPC_NO_<NAME>`` (1/true/yes/on).  The agent passes the ones that are off to
its workers under the same variable names, so the code that runs inside a worker (the hooks,
the signal mask, the in-process wrapper) reads one name.  With every one off a worker is what
torchrun starts: ``python -u script.py`` with torchrun's variables (and dlrover-hpc's, which only
its own API reads); crash recovery, flash checkpoints and the master work as before, and hang
detection falls back to explicit progress (:func:`dlrover_hpc.progress.step`, checkpoint saves).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Injection:
    name: str  # flag --no-<name with dashes>, TOML no_<name>, env DLROVER_HPC_NO_<NAME>
    what: str  # what workers do with it on, after "workers ...": for --help and the reference
    cost: str  # what turning it off costs

    @property
    def flag(self) -> str:
        return "--no-" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        return "no_" + self.name

    @property
    def env(self) -> str:
        return "DLROVER_HPC_NO_" + self.name.upper()


PREWARM = Injection(
    name="prewarm",
    what="are forked from a pre-warmed interpreter that imported torch once per node",
    cost="each worker start pays Python's start-up and `import torch` (about 1-2 s of CPU per "
    "worker here, more on a busy node): every restart takes that much longer",
)
WORKER_HOOKS = Injection(
    name="worker_hooks",
    what="run progress hooks (optimizer steps, eval() and data-loader sections, SIGUSR2 stack "
    "dumps)",
    cost="hang detection sees only explicit progress (dlrover_hpc.progress.step, flash "
    "checkpoint saves) and CPU use: no learned bound from the step times, no straggler "
    "detection, no eval/data sections",
)
USR1_HOLD = Injection(
    name="usr1_hold",
    what="block Slurm's USR1 (the master saves and requeues at a time limit)",
    cost="a USR1 from Slurm (--signal) reaches the script as under torchrun: a script without "
    "a handler dies of it",
)
SLURM_ENV_REWRITE = Injection(
    name="slurm_env_rewrite",
    what="see SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and SLURM_NODEID rewritten to their rank",
    cost="a framework that reads SLURM_* (Lightning's SLURMEnvironment) sees the agent's task, "
    "as under torchrun, and may disagree with RANK",
)
GC_HANDLING = Injection(
    name="gc_handling",
    what="freeze their long-lived objects (gc.freeze) for in-process recovery, before the "
    "first attempt and after each collection",
    cost="a round change walks every object in a full collection (about 0.16 s here with torch "
    "imported); the attempt's garbage is still collected",
)
ALL = (PREWARM, WORKER_HOOKS, USR1_HOLD, SLURM_ENV_REWRITE, GC_HANDLING)
BY_NAME = {i.name: i for i in ALL}
TRANSPARENT_ENV = "DLROVER_HPC_TRANSPARENT"
_TRUE = frozenset({"1", "true", "yes", "on"})


def enabled(injection: Injection, env: Mapping[str, str] | None = None) -> bool:
    """Inside a worker: whether the agent (or the user's environment) left it on."""
    env = os.environ if env is None else env
    return env.get(injection.env, "").strip().lower() not in _TRUE


def worker_env(off: Iterable[str]) -> dict[str, str]:
    """The variables that tell a worker which injections are off (names of :data:`ALL`)."""
    return {BY_NAME[name].env: "1" for name in off}
