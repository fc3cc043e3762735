"""`ElasticTrainer`: a fixed global batch while the world size changes, by gradient accumulation.

DLRover's ``dlrover.trainer.torch.elastic.trainer`` API.  The global batch is
``micro batch size x world size x gradient_accumulation_steps``; the trainer sets the
accumulation steps from the world size (``torch.distributed``'s when initialized, else
``$WORLD_SIZE``) so that the global batch stays ``global_batch_size``.  When it cannot be kept
exactly (``global_batch_size`` is not a multiple of ``micro x world``) the nearest number of
steps is used and a warning names the numbers and the global batch actually used.

Without ``global_batch_size`` the target is DLRover's: ``$WORKER_NUM`` nodes of
``$LOCAL_WORLD_SIZE`` processes (the largest world) accumulate once each, i.e.
``gradient_accumulation_steps = WORKER_NUM * LOCAL_WORLD_SIZE // world size`` (1 when
``$WORKER_NUM`` is unset); as in DLRover, ``step()`` then accumulates only when called with
``fix_total_batch_size=True``.  Unlike DLRover, every rank uses the same number of steps (ranks
that accumulate different numbers of micro-batches would wait on each other's all-reduce).

Inside ``with trainer.step():`` the optimizer returned by `ElasticTrainer.prepare` steps only
on the window's last micro-step, the model's ``no_sync()`` (DDP, FSDP) skips the gradient
all-reduce on the others, and ``zero_grad()`` does not clear a window's gradients before its
step, whether the script zeroes before its backward or after its step.  To get the global
batch's mean gradient, divide each micro-step's loss by `gradient_accumulation_steps` (as with
any accumulation); the learning-rate scheduler steps with the optimizer, once per window.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, overload

import torch
import torch.distributed as dist

from dlrover_hpc.trainer.elastic.dataloader import ElasticDataLoader

log = logging.getLogger(__name__)


def world_size() -> int:
    """``torch.distributed``'s world size when initialized, else ``$WORLD_SIZE`` (default 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _env_int("WORLD_SIZE", 1, least=1)


def _env_int(name: str, default: int, *, least: int = 0) -> int:
    raw = os.environ.get(name, "")
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None
    if value < least:
        raise ValueError(f"${name} must be >= {least}, got {value}")
    return value


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world: int) -> int:
    """Micro-steps per optimizer step for the global batch nearest ``global_batch_size``.

    ``global_batch_size / (micro_batch_size * world)`` rounded half up, at least 1.
    """
    per_step = micro_batch_size * world
    return max(1, (2 * global_batch_size + per_step) // (2 * per_step))


class GradientState:
    """Where the trainer is in its accumulation window; shared with its optimizer wrapper.

    DLRover's attributes: ``sync_gradients`` (this micro-step ends the window: gradients are
    all-reduced and the optimizer steps), ``num_backward_steps`` (micro-steps so far) and
    ``num_steps`` (optimizer steps since `ElasticTrainer.reset`).
    """

    def __init__(self) -> None:
        self.sync_gradients = True
        self.num_backward_steps = 0
        self.num_steps = 0
        self.in_step = False  # inside `with trainer.step()`
        self.micro_in_window = 0  # index of the current micro-step in its window
        self.stepped = False  # the optimizer stepped since the last real zero_grad
        self.step_called = False  # optimizer.step() was called in this micro-step


class _ElasticOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer: ``step()`` and ``zero_grad()`` act only where the window allows.

    ``step()`` steps on the window's last micro-step; ``zero_grad()`` clears gradients unless
    they hold the current window's, i.e. it acts after a real step, and before the window's
    first backward (called before ``step()`` in the window's first micro-step).  Outside
    ``trainer.step()`` both act.  Other attributes are the wrapped optimizer's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState) -> None:
        # No super().__init__: the state, parameter groups and hooks are the wrapped one's.
        self.optimizer = optimizer
        self.gradient_state = gradient_state

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> Any:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def __getattr__(self, name: str) -> Any:
        if name in ("optimizer", "gradient_state"):  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        gs = self.gradient_state
        if gs.in_step and not gs.stepped and (gs.micro_in_window > 0 or gs.step_called):
            return  # the window's gradients, not yet used by a step
        gs.stepped = False
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        gs = self.gradient_state
        if gs.in_step:
            gs.step_called = True
            if not gs.sync_gradients:
                return None
        gs.stepped = True
        return self.optimizer.step(closure)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


class _ElasticLRScheduler:
    """Wraps a learning-rate scheduler: ``step()`` acts once per window, with the optimizer."""

    def __init__(self, scheduler: Any, gradient_state: GradientState) -> None:
        self.scheduler = scheduler
        self.gradient_state = gradient_state

    def step(self, *args: Any, **kwargs: Any) -> None:
        gs = self.gradient_state
        if gs.in_step and not gs.sync_gradients:
            return
        self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> Any:
        return self.scheduler.get_last_lr()

    def get_lr(self) -> Any:
        return self.scheduler.get_lr()

    def print_lr(self, *args: Any, **kwargs: Any) -> Any:
        return self.scheduler.print_lr(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "gradient_state"):
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class ElasticTrainer:
    """Keeps the global batch fixed when the number of workers changes.

    Args:
        model: the model (DDP/FSDP: its ``no_sync`` skips all-reduces inside a window).
        dataloader: the training loader; its batch size is the micro batch size, and an
            `ElasticDataLoader` reloads its config file after each optimizer step.
        global_batch_size: samples per optimizer step over all ranks; the accumulation
            steps follow the world size to keep it.  Default: DLRover's ``$WORKER_NUM`` rule.
        micro_batch_size: samples per micro-step on one rank; default the dataloader's.

    Example::

        trainer = ElasticTrainer(model, dataloader=loader, global_batch_size=1024)
        optimizer, scheduler = trainer.prepare(optimizer, scheduler)
        for x, y in loader:
            with trainer.step():
                loss = loss_fn(model(x), y) / trainer.gradient_accumulation_steps
                loss.backward()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        dataloader: Any = None,
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
    ) -> None:
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.model = model
        self.dataloader = dataloader
        self.global_batch_size = global_batch_size
        self._micro_batch_size = micro_batch_size
        self.gradient_state = GradientState()
        if dataloader is not None and not isinstance(dataloader, ElasticDataLoader):
            log.warning(
                "The batch size of a %s cannot change during training; use ElasticDataLoader",
                type(dataloader).__name__,
            )
        if global_batch_size is not None and self.micro_batch_size is None:
            raise ValueError(
                "global_batch_size needs the micro batch size: pass dataloader= (one built "
                "with batch_size=N) or micro_batch_size="
            )
        self._gas = 1
        self._last_key: tuple[int, int | None, int] | None = None
        self._set_gradient_accumulation_steps()

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per micro-step on one rank: ``micro_batch_size=`` or the dataloader's."""
        if self._micro_batch_size is not None:
            return self._micro_batch_size
        return getattr(self.dataloader, "batch_size", None)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step (set by `prepare` and `reset`)."""
        return self._gas

    @property
    def num_steps(self) -> int:
        """Optimizer steps since the last `reset`."""
        return self.gradient_state.num_steps

    @overload
    def prepare(self, optimizer: torch.optim.Optimizer) -> _ElasticOptimizer: ...

    @overload
    def prepare(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any
    ) -> tuple[_ElasticOptimizer, _ElasticLRScheduler]: ...

    def prepare(
        self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None
    ) -> _ElasticOptimizer | tuple[_ElasticOptimizer, _ElasticLRScheduler]:
        """Wraps the optimizer (and scheduler): they step once per accumulation window."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self._set_gradient_accumulation_steps()
        wrapped = _ElasticOptimizer(optimizer, self.gradient_state)
        if lr_scheduler is None:
            return wrapped
        return wrapped, _ElasticLRScheduler(lr_scheduler, self.gradient_state)

    @contextlib.contextmanager
    def step(self, fix_total_batch_size: bool | None = None) -> Iterator[None]:
        """One micro-step: forward, backward, ``optimizer.step()``, ``zero_grad()``.

        ``fix_total_batch_size``: accumulate `gradient_accumulation_steps` micro-steps per
        optimizer step (True), or step every time (False, DLRover's default).  Default: True
        when the trainer has a ``global_batch_size``, else False.
        """
        if fix_total_batch_size is None:
            fix_total_batch_size = self.global_batch_size is not None
        gs = self.gradient_state
        gs.num_backward_steps += 1
        gs.step_called = False
        window = self._gas if fix_total_batch_size else 1
        gs.sync_gradients = gs.micro_in_window + 1 >= window
        no_sync = getattr(self.model, "no_sync", None)
        context = contextlib.nullcontext() if gs.sync_gradients or no_sync is None else no_sync()
        gs.in_step = True
        try:
            with context:
                yield
        finally:
            gs.in_step = False
        if gs.sync_gradients:
            gs.micro_in_window = 0
            gs.num_steps += 1
            if isinstance(self.dataloader, ElasticDataLoader):
                self.dataloader.update_batch_size()
        else:
            gs.micro_in_window += 1

    def reset(self) -> None:
        """Recomputes the accumulation steps (world or batch size changed); ``num_steps = 0``.

        Call it on every rank at the same point.  An unfinished window (an epoch that ended
        inside one) goes on: its gradients are kept and stepped with the rest of it, and it
        ends once it has the new number of micro-steps.
        """
        self.gradient_state.num_steps = 0
        self._set_gradient_accumulation_steps()

    def _set_gradient_accumulation_steps(self) -> None:
        world = world_size()
        micro = self.micro_batch_size
        if self.global_batch_size is not None and micro is not None:
            gas = accumulation_steps(self.global_batch_size, micro, world)
            target, used = self.global_batch_size, gas * micro * world
            unit = "samples"
            problem = (
                f"global_batch_size={target} is not a multiple of micro batch {micro} x "
                f"world size {world} = {micro * world}"
            )
        else:  # DLRover's rule: as many micro-batches per step as the largest world has ranks
            target = _env_int("WORKER_NUM", 0) * _env_int("LOCAL_WORLD_SIZE", 1, least=1)
            gas = max(1, target // world)
            used = gas * world if target else target
            unit = "micro-batches"
            problem = (
                f"WORKER_NUM x LOCAL_WORLD_SIZE = {target} micro-batches is not a multiple "
                f"of world size {world}"
            )
        key = (target, micro, world)
        if key != self._last_key:
            self._last_key = key
            if used != target:
                log.warning(
                    "%s: accumulating %d micro-batches per step, so the global batch is %d %s",
                    problem,
                    gas,
                    used,
                    unit,
                )
            log.info(
                "World size %d, micro batch %s: %d gradient accumulation steps", world, micro, gas
            )
        self._gas = gas
