"""Is a restored state fit to train on?  Non-finite tensors, and the user's own check.

A restore runs `RestoreCheck.why_rejected` on the state it loaded, on every rank, before it
returns it (`restore_agreement`): a NaN or an infinity in a floating tensor (a step saved
after the loss diverged, a bit flip, a poisoned write) or a `validate(state)` that returns
False rejects the step, and every rank moves to the next older one together.

The finite check walks the state as the checkpoint API holds it (nested dicts, lists and
tuples; a DTensor's or a ShardedTensor's local part) and costs one reduction per tensor:
``sum()`` is finite exactly when every element is (a NaN or an infinity never sums to a
finite value); only a non-finite sum, which a finite tensor gives only by overflowing, is
looked at element by element.  `benchmarks/restore_check.py` measures it against the
restore's own copy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: a user's check of a restored state: True when it is fit to train on
Validate = Callable[[Any], bool]

#: elements per piece of the exact check (its mask stays in cache)
_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCheck:
    """What a restored state must pass before training goes on."""

    #: reject a state holding a NaN or an infinity in a floating tensor
    finite: bool = True
    #: the user's check, or None
    validate: Validate | None = None

    @property
    def active(self) -> bool:
        return self.finite or self.validate is not None

    def why_rejected(self, state: Any) -> str | None:
        """Why `state` must not be trained on, or None when it passes.  A `validate` that
        raises rejects the step with its error (raising here would leave the other ranks
        waiting in the restore's vote)."""
        if self.finite:
            found = first_nonfinite(state)
            if found is not None:
                return found
        if self.validate is None:
            return None
        try:
            ok = self.validate(state)
        except Exception as exc:  # the user's code, at the restore's boundary
            logger.exception("checkpoint validate_raised")
            return f"validate() raised {type(exc).__name__}: {exc}"
        if ok is not True and ok is not False:
            return f"validate() returned {ok!r}, not True or False"
        return None if ok else "validate() returned False"


def first_nonfinite(state: Any) -> str | None:
    """``non-finite values in model.0.weight (3 of 4096: nan)`` for the first floating tensor
    of `state` holding a NaN or an infinity, or None when all are finite."""
    for path, tensor in floating_tensors(state):
        if _all_finite(tensor):
            continue
        bad = ~torch.isfinite(tensor.detach())
        count = int(bad.sum())
        first = tensor.detach().reshape(-1)[bad.reshape(-1).nonzero()[0]].item()
        return f"non-finite values in {path or 'the state'} ({count} of {tensor.numel()}: {first})"
    return None


def floating_tensors(state: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted path, tensor) of each floating (or complex) tensor in `state`: nested dicts,
    lists and tuples; this rank's local part of a DTensor or a ShardedTensor."""
    if isinstance(state, torch.Tensor):
        local = _local(state)
        for i, t in enumerate(local):
            if t.is_floating_point() or t.is_complex():
                yield (path if len(local) == 1 else f"{path}[shard {i}]"), t
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from floating_tensors(value, f"{path}.{key}" if path else str(key))
    elif isinstance(state, list | tuple):
        for i, value in enumerate(state):
            yield from floating_tensors(value, f"{path}.{i}" if path else str(i))


def _local(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensors this rank holds of `tensor`: itself, a DTensor's local tensor, or a
    ShardedTensor's local shards (the others' parts are checked on their ranks)."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local) and type(tensor).__name__ == "DTensor":
        return [to_local()]
    local_shards = getattr(tensor, "local_shards", None)
    if callable(local_shards):
        return [s.tensor for s in local_shards()]
    return [tensor]


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when every element is finite (a finite sum proves it; one reduction)."""
    if tensor.numel() == 0:
        return True
    flat = tensor.detach().reshape(-1)
    if bool(torch.isfinite(flat.sum())):
        return True
    return all(
        bool(torch.isfinite(flat[i : i + _PIECE]).all()) for i in range(0, flat.numel(), _PIECE)
    )
