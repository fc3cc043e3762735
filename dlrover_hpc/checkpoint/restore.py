"""Restore: agree across ranks where to load from, then read views and copy them out.

Memory is used when every rank holds the same newest step, or at least all hold the newest
step the slowest rank has, and that step is not older than storage's newest committed step.
Otherwise each rank loads the newest committed step it can verify; ranks agree on success and
step back together when any of them fails.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dlrover_hpc.checkpoint.shm import HEADER_SIZE, Header
from dlrover_hpc.checkpoint.torchfile import MANIFEST, ViewUnpickler, buffer_view
from dlrover_hpc.checkpoint.transfer import Copier
from dlrover_hpc.checkpoint.zipfmt import crc32, read_directory
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


class Source(enum.Enum):
    MEMORY = "memory"
    STORAGE = "storage"
    NONE = "none"


def decide(
    *, mem_max: int, mem_min: int, all_hold_min: bool, committed_max: int
) -> tuple[Source, int]:
    """Pure decision from agreed values (-1 means "none")."""
    if mem_min >= 0 and mem_min >= committed_max and (mem_min == mem_max or all_hold_min):
        return Source.MEMORY, mem_min
    if committed_max >= 0:
        return Source.STORAGE, committed_max
    return Source.NONE, -1


class Agreement:
    """Collectives for the restore decision; trivial without torch.distributed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self.world = self._dist.get_world_size() if self._dist else 1

    @property
    def active(self) -> bool:
        return self._dist is not None and self.world > 1

    def _device(self) -> torch.device:
        assert self._dist is not None
        if self._dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def max(self, values: Iterable[int]) -> list[int]:
        vals = list(values)
        if not self.active:
            return vals
        assert self._dist is not None
        t = torch.tensor(vals, dtype=torch.int64, device=self._device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def all(self, flag: bool) -> bool:
        return -self.max([-int(bool(flag))])[0] == 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    source: Source
    step: int
    token: int
    storage_steps: tuple[int, ...]  # agreed candidates, newest first, when from storage


def choose(agreement: Agreement, *, memory: set[int], committed: list[int], token: int) -> Choice:
    newest = max(memory, default=-1)
    top = committed[0] if committed else -1
    # -1 is "none"; the maximum of negated values is the negated minimum
    mem_max, neg_min, c_max, neg_c_min, token = agreement.max([newest, -newest, top, -top, token])
    mem_min, c_min = -neg_min, -neg_c_min
    all_hold = mem_min >= 0 and agreement.all(mem_min in memory)
    source, step = decide(
        mem_max=mem_max, mem_min=mem_min, all_hold_min=all_hold, committed_max=c_max
    )
    if source == Source.STORAGE:
        step = c_min
        source = Source.STORAGE if c_min >= 0 else Source.NONE
    return Choice(
        source=source,
        step=step,
        token=token,
        storage_steps=tuple(s for s in committed if s <= step) if source == Source.STORAGE else (),
    )


def next_candidate(agreement: Agreement, local: Iterable[int], below: int) -> int:
    """The next step to try below `below` that every rank proposes (-1 when none)."""
    mine = max((s for s in local if s < below), default=-1)
    return -agreement.max([-mine])[0]


# ---------------------------------------------------------------------------------- copying


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


# ---------------------------------------------------------------------------------- reading


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


def views_from_file(
    buf: Any,
    *,
    verify: bool,
    weights_only: bool,
    expect: dict[str, Any] | None = None,
    threads: int = 4,
) -> Any:
    """The state in a torch.save-format archive held in `buf` (an mmap'd file)."""
    records = read_directory(buf)
    pkl_name = next((n for n in records if n.endswith("/data.pkl")), None)
    if pkl_name is None:
        raise CheckpointError("the archive has no data.pkl record; not a torch.save file")
    prefix = pkl_name[: -len("data.pkl")]
    view = memoryview(buf)
    if verify:
        verify_records(view, records.values(), threads=threads)
    if expect:
        raw = records.get(MANIFEST)
        manifest = {}
        if raw is not None:
            manifest = json.loads(bytes(view[raw.data_offset : raw.data_offset + raw.size]))
        for key, want in expect.items():
            if manifest.get(key) != want:
                raise CheckpointError(
                    f"the file holds {key}={manifest.get(key)!r}, expected {want!r}; "
                    "it belongs to another save"
                )
    pkl = records[pkl_name]
    data = bytes(view[pkl.data_offset : pkl.data_offset + pkl.size])

    def resolve(key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        rec = records.get(f"{prefix}data/{key}")
        if rec is None:
            raise CheckpointError(f"data.pkl refers to storage {key} that the archive lacks")
        if numel * torch.empty(0, dtype=dtype).element_size() > rec.size:
            raise CheckpointError(f"storage {key} is shorter than data.pkl says")
        return buffer_view(buf, rec.data_offset, dtype, numel)

    return ViewUnpickler(data, resolve, weights_only=weights_only).load()


def verify_records(view: memoryview, records: Iterable[Any], *, threads: int = 4) -> None:
    """Checks every record's CRC-32 (in parallel; zlib releases the GIL)."""
    items = sorted(records, key=lambda r: r.size, reverse=True)

    def check(rec: Any) -> str | None:
        value = crc32(view[rec.data_offset : rec.data_offset + rec.size])
        if value != rec.crc:
            return f"record {rec.name} has CRC {value:08x}, the directory says {rec.crc:08x}"
        return None

    with ThreadPoolExecutor(max(1, threads)) as pool:
        errors = [e for e in pool.map(check, items) if e]
    if errors:
        raise CheckpointError("checkpoint file is corrupt: " + "; ".join(errors[:3]))


def with_fallback(
    agreement: Agreement,
    steps: list[int],
    first: int,
    load: Callable[[int], tuple[Any, int]],
) -> tuple[int, Any]:
    """Loads `first`, or steps back together with the other ranks until all succeed.

    `load` returns the state and a signature (the save token) that must match on every rank,
    so parts of two different saves of one step are never combined.
    """
    step = first
    while step >= 0:
        result: Any = None
        signature = -1
        error: Exception | None = None
        if step in steps:
            try:
                result, signature = load(step)
            except (CheckpointError, OSError, ValueError, RuntimeError) as exc:
                error = exc
        else:
            error = CheckpointError(f"no commit record for step {step} on this rank")
        ok = agreement.all(error is None)
        high, neg_low = agreement.max([signature, -signature])
        if ok and high == -neg_low:
            return step, result
        if ok:
            error = CheckpointError(f"the ranks' parts of step {step} come from different saves")
        if error is not None:
            logger.warning("checkpoint storage_step_unusable step=%d error=%s", step, error)
        step = next_candidate(agreement, steps, step)
    return -1, None
