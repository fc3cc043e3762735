"""What a worker sets up before the training script runs, so that it can be watched unchanged.

The zygote's forked worker calls :func:`install` (a worker started without the zygote reports
only explicit :func:`dlrover_hpc.progress.step` calls and flash-checkpoint saves):

- every optimizer step reports progress (torch's global optimizer step hook: one Python call
  per step); with ``DLROVER_HPC_FORWARD_TIMING=1`` the seconds spent in the model's forward are
  measured as well (global module hooks), for runtime straggler detection;
- ``SIGUSR2`` makes faulthandler write every thread's stack to ``<progress file>.stack``: the
  agent's fallback where the kernel forbids reading another process's memory;
- the process lets any process of its user read it (``PR_SET_PTRACER_ANY``) so that py-spy,
  started by the agent, may under Yama's ``ptrace_scope=1``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys
import time
from typing import Any

from dlrover_hpc import progress

FORWARD_TIMING_ENV = "DLROVER_HPC_FORWARD_TIMING"
STACK_SIGNAL = signal.SIGUSR2
_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
_WRAPPERS = ("DistributedDataParallel", "FullyShardedDataParallel")
_keep: list[Any] = []  # the stack file and the hook handles live as long as the process


def stack_file(progress_path: str) -> str:
    return f"{progress_path}.stack"


def install() -> None:
    """Never raises: a worker must run even where a hook cannot be set up."""
    try:
        _install()
    except Exception as exc:  # the training script matters more than the hooks
        print(f"dlrover-run: worker hooks not installed: {exc!r}", file=sys.stderr)


def _install() -> None:
    path = os.environ.get(progress.PATH_ENV, "")
    if not path:
        return
    _allow_stack_readers()
    f = open(stack_file(path), "a")  # noqa: SIM115 - kept open for faulthandler
    _keep.append(f)
    faulthandler.register(STACK_SIGNAL, file=f, all_threads=True, chain=False)
    # The first record tells the agent this process's pid, and that SIGUSR2 is safe to send.
    progress.step(0)
    if "torch" in sys.modules:  # the zygote imported it; a plain worker may not use torch
        _torch_hooks(forward=os.environ.get(FORWARD_TIMING_ENV) == "1")


def _allow_stack_readers() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no Yama, or no prctl: nothing to allow


class _ForwardClock:
    """Seconds from the first module forward after an optimizer step to the last one before
    the next step: the rank's own compute (wrappers whose forward synchronizes are skipped),
    smoothed over about ten steps so one slow step is not a straggler."""

    def __init__(self) -> None:
        self.start = 0.0
        self.end = 0.0
        self.mean = 0.0

    def pre(self, module: Any, _args: Any) -> None:
        if not self.start and type(module).__name__ not in _WRAPPERS:
            self.start = time.perf_counter()

    def post(self, module: Any, _args: Any, _out: Any) -> None:
        if self.start and type(module).__name__ not in _WRAPPERS:
            self.end = time.perf_counter()

    def take(self) -> float:
        if self.start:
            seconds = max(0.0, self.end - self.start)
            self.mean = 0.9 * self.mean + 0.1 * seconds if self.mean else seconds
        self.start = self.end = 0.0
        return self.mean


def _torch_hooks(*, forward: bool) -> None:
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import register_optimizer_step_post_hook

    clock = _ForwardClock() if forward else None
    if clock is not None:
        _keep.append(register_module_forward_pre_hook(clock.pre))
        _keep.append(register_module_forward_hook(clock.post))

    def stepped(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        progress.step(forward_s=clock.take() if clock is not None else 0.0)

    _keep.append(register_optimizer_step_post_hook(stepped))
