"""Is a restored state fit to train on?  Non-finite tensors, and the user's own check.

A restore runs `RestoreCheck.why_rejected` on the state it loaded, on every rank, before it
returns it (`restore_agreement`): a NaN or an infinity in a floating tensor (a step saved
after the loss diverged, a bit flip, a poisoned write) or a `validate(state)` that returns
False rejects the step, and every rank moves to the next older one together.

The finite check walks the state as the checkpoint API holds it (nested dicts, lists and
tuples; a DTensor's or a ShardedTensor's local part) and costs one reduction per tensor and
one synchronisation per device: a finite ``sum()`` proves every element finite (a NaN or an
infinity never sums to a finite value); only when some sum is not finite, which a finite
tensor gives only by overflowing, are the tensors looked at element by element.
`benchmarks/restore_check.py` measures it against the restore's own copy.
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
    found = list(floating_tensors(state))
    if _sums_finite([t for _, t in found]):
        return None
    for path, tensor in found:
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


def _sums_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor's sum is finite, which proves every element is: one reduction
    per tensor (on a GPU half precision sums in float32, so it does not overflow) and one
    synchronisation per device.  False says only "look closer" (a sum may overflow)."""
    sums: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            total = torch.view_as_real(flat.sum()).sum().to(torch.float64)
        elif flat.is_cuda and flat.element_size() < 4:  # free on a GPU, 15x on a CPU
            total = flat.sum(dtype=torch.float32).to(torch.float64)
        else:
            total = flat.sum().to(torch.float64)
        sums.setdefault(total.device, []).append(total)
    return all(bool(torch.isfinite(torch.stack(group)).all()) for group in sums.values())


def _all_finite(tensor: torch.Tensor) -> bool:
    """True when every element of `tensor` is finite (exact, piece by piece)."""
    flat = tensor.detach().reshape(-1)
    return all(
        bool(torch.isfinite(flat[i : i + _PIECE]).all()) for i in range(0, flat.numel(), _PIECE)
    )
