"""A restored state: views over a step's bytes, copied into the caller's tensors.

The bytes are a segment of this node (`memory_step.MemoryStep`) or a peer's copy of one
(`peer_transfer.ReceivedStep`); a restore reads both the same way (`StepBytes`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from dlrover_hpc.checkpoint.formats.torchfile import ViewUnpickler, buffer_view
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Header
from dlrover_hpc.checkpoint.trainer.tensor_copy import Copier
from dlrover_hpc.errors import CheckpointError


class StepBytes(Protocol):
    """A complete step's bytes laid out as in a segment (header, image, meta)."""

    @property
    def header(self) -> Header: ...

    @property
    def buf(self) -> Any: ...

    @property
    def token(self) -> int: ...

    @property
    def name(self) -> str: ...

    def reading(self) -> AbstractContextManager[None]:
        """Held while reading: a segment's shared lock (no save may overwrite it)."""
        ...


def views_from_segment(buf: Any, header: Header, *, weights_only: bool) -> Any:
    """The state held by a torch-file segment, its tensors viewing `buf` (no copy)."""
    info = header.meta.get("restore") or {}
    try:
        pkl_off, pkl_len = info["pickle"]
        slots = info["slots"]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"segment of step {header.step} has no restore info") from exc
    start = HEADER_SIZE + pkl_off
    data = bytes(memoryview(buf)[start : start + pkl_len])

    def resolve(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return buffer_view(buf, HEADER_SIZE + int(slots[key]), dtype, numel)

    return ViewUnpickler(data, resolve, weights_only=weights_only).load()


def merge_into(result: Any, target: Any, copier: Copier) -> Any:
    """`result` with each tensor copied into the matching tensor of `target` (same path,
    shape and dtype) or cloned into fresh memory; views over buffers never escape."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    merged = _merge(result, target, pairs)
    copier.copy(pairs)
    return merged


def _merge(result: Any, target: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    if isinstance(result, torch.Tensor):
        if (
            isinstance(target, torch.Tensor)
            and target.shape == result.shape
            and target.dtype == result.dtype
        ):
            pairs.append((target, result))
            return target
        return result.clone()
    if isinstance(result, dict):
        has = isinstance(target, dict)
        for key in list(result):
            result[key] = _merge(result[key], target.get(key) if has else None, pairs)
        return result
    if isinstance(result, list | tuple):
        seq = target if isinstance(target, list | tuple) else ()
        items = [_merge(v, seq[i] if i < len(seq) else None, pairs) for i, v in enumerate(result)]
        if isinstance(result, list):
            result[:] = items
            return result
        return type(result)(*items) if hasattr(result, "_fields") else type(result)(items)
    return result
