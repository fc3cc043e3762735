"""What a worker sets up before the training script runs, so that it can be watched unchanged.

The zygote's forked worker calls :func:`install` (a worker started without the zygote reports
only explicit :func:`dlrover_hpc.progress.step` calls and flash-checkpoint saves):

- every optimizer step reports progress (torch's global optimizer step hooks: two Python calls
  per step) with the step's *compute* and *wait* seconds: the time from the previous step to
  the last gradient computed (data, forward, backward), plus the optimizer's own; and the time
  from that gradient to the optimizer (DDP's final all-reduce waits there for the slowest
  rank).  One hook per optimized parameter notes when its gradient is accumulated.  The master
  compares ranks' compute to find a slow node (fail-slow);
- long phases that are not hangs open a section (:func:`dlrover_hpc.progress.section`):
  ``Module.eval()`` opens ``eval`` until ``train()`` or the next optimizer step, a data
  loader's iterator opens ``data`` until its first batch;
- with :data:`environ.FORWARD_TIMING` set to 1 the seconds spent in the model's forward are measured
  as well (global module hooks);
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
import weakref
from typing import Any

from dlrover_hpc import environ, injections
from dlrover_hpc.worker import progress

FORWARD_TIMING_ENV = environ.FORWARD_TIMING
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
    if not path or not injections.enabled(injections.WORKER_HOOKS):
        return
    progress.adopt()  # forked from the zygote: the record is this worker's own
    _allow_stack_readers()
    # Its own user's only, like the progress record beside it (a shared node's /dev/shm).
    fd = os.open(stack_file(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    f = os.fdopen(fd, "a")  # kept open for faulthandler
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


_HOOKED = "_dlrover_hpc_grad_hooked"  # set on a parameter once its gradient hook is in place
#: ``eval()`` opens the ``eval`` section only on a module that holds at least this share of the
#: optimized parameters: ``model.eval()``, not ``model.bn.eval()`` on a frozen part every step.
EVAL_SHARE = 0.5


class _StepClock:
    """A step's compute and wait: see the module's docstring.  Nothing here may raise into the
    training script: each hook's body is guarded."""

    def __init__(self) -> None:
        self.prev_end = time.perf_counter()
        self.last_grad = 0.0
        self.opt_start = 0.0
        self.hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers seen
        self.optimized = 0  # elements of the parameters of the largest optimizer seen
        self.eval_token = 0
        self.data_tokens: set[int] = set()  # data loaders' first batches still awaited

    def grad_ready(self, _param: Any) -> None:
        self.last_grad = time.perf_counter()

    def before_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        self.opt_start = time.perf_counter()
        try:
            if optimizer not in self.hooked:
                self.hooked.add(optimizer)
                self._hook_params(optimizer)
        except Exception as exc:  # a hook that cannot be set up must not stop training
            _warn_once(f"step timing hooks not installed: {exc!r}")

    def _hook_params(self, optimizer: Any) -> None:
        mine = 0
        for group in optimizer.param_groups:
            for param in group["params"]:
                mine += int(param.numel())
                if getattr(param, _HOOKED, False) or not (param.requires_grad and param.is_leaf):
                    continue  # hooked for an earlier optimizer; or not a leaf: no such hook
                hook = getattr(param, "register_post_accumulate_grad_hook", None)
                if hook is not None:
                    _keep.append(hook(self.grad_ready))
                    setattr(param, _HOOKED, True)
        self.optimized = max(self.optimized, mine)

    def after_step(self) -> tuple[float, float]:
        end = time.perf_counter()
        start = self.opt_start or end
        if self.last_grad > self.prev_end:
            compute = (self.last_grad - self.prev_end) + (end - start)
            wait = max(0.0, start - self.last_grad)
        else:  # no gradient seen (the first step after hooking, or no autograd)
            compute, wait = end - self.prev_end, 0.0
        self.prev_end, self.opt_start = end, 0.0
        # An optimizer step: training again, whatever eval() said; and a data loader that
        # gave no batch since its iterator was made is not starting (an iterator made early).
        if self.eval_token:
            progress.leave_section(self.eval_token)
            self.eval_token = 0
        for token in self.data_tokens:
            progress.leave_section(token)
        self.data_tokens.clear()
        return compute, wait


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        print(f"dlrover-run: {text}", file=sys.stderr)


def _torch_hooks(*, forward: bool) -> None:
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    clock = _ForwardClock() if forward else None
    if clock is not None:
        _keep.append(register_module_forward_pre_hook(clock.pre))
        _keep.append(register_module_forward_hook(clock.post))
    steps = _StepClock()

    def stepped(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            compute, wait = steps.after_step()
            forward_s = clock.take() if clock is not None else 0.0
            progress.step(forward_s=forward_s, compute_s=compute, wait_s=wait)
        except Exception as exc:
            _warn_once(f"progress not reported: {exc!r}")

    _keep.append(register_optimizer_step_pre_hook(steps.before_step))
    _keep.append(register_optimizer_step_post_hook(stepped))
    _eval_sections(steps)
    _data_sections(steps)


def _eval_sections(steps: _StepClock) -> None:
    """``Module.train(False)`` (what ``eval()`` calls) on a module that holds most of the
    optimized parameters (or any, before an optimizer stepped) opens the ``eval`` section."""
    import torch.nn

    original = torch.nn.Module.train
    depth = [0]  # train() calls itself on every child: only the outermost call decides

    def train(self: Any, mode: bool = True) -> Any:
        if depth[0] == 0:
            try:
                if mode:
                    if steps.eval_token:
                        progress.leave_section(steps.eval_token)
                        steps.eval_token = 0
                elif not steps.eval_token and _holds_most(self, steps.optimized):
                    steps.eval_token = progress.enter_section("eval")
            except Exception as exc:
                _warn_once(f"eval section not marked: {exc!r}")
        depth[0] += 1
        try:
            return original(self, mode)
        finally:
            depth[0] -= 1

    train.__wrapped__ = original  # type: ignore[attr-defined]
    train.__doc__ = original.__doc__
    torch.nn.Module.train = train  # type: ignore[method-assign]


def _holds_most(module: Any, optimized: int) -> bool:
    if not optimized:
        return True
    mine = sum(int(p.numel()) for p in module.parameters())
    return mine >= EVAL_SHARE * optimized


def _data_sections(steps: _StepClock) -> None:
    """A data loader's iterator opens the ``data`` section until its first batch (worker
    processes start, datasets open files): the next ``__next__`` that returns or ends, the
    next optimizer step, or the iterator's end, whichever comes first."""
    from torch.utils.data import dataloader

    base = dataloader._BaseDataLoaderIter
    original_init, original_next = base.__init__, base.__next__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        token = progress.enter_section("data")
        steps.data_tokens.add(token)
        self._dlrover_hpc_section = token
        weakref.finalize(self, _leave_data, steps, token)
        original_init(self, *args, **kwargs)

    def next_(self: Any) -> Any:
        token = self.__dict__.get("_dlrover_hpc_section", 0)
        if not token:
            return original_next(self)
        try:
            return original_next(self)
        finally:
            self._dlrover_hpc_section = 0
            _leave_data(steps, token)

    base.__init__ = init  # type: ignore[method-assign]
    base.__next__ = next_  # type: ignore[method-assign]


def _leave_data(steps: _StepClock, token: int) -> None:
    if token in steps.data_tokens:
        steps.data_tokens.discard(token)
        progress.leave_section(token)
