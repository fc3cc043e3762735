"""Restore agreement: every rank restores the same step from the same source, or none does.

One collective gathers what each rank holds: the complete steps in its shared memory (with
the save token of each) and the newest committed step it sees on storage.  Every rank then
computes the same `Choice` from the same values (`plan_restore`, pure).  Memory is used when
every rank holds the same newest step, or at least all hold the newest step the slowest rank
has (from one save), and that step is not older than storage's newest committed step.

A restore then tries candidates in an agreed order, the memory step first when chosen, then
committed steps newest first.  Each try has two phases with a vote after each: `prepare`
(local: open, map, verify; it may fail on one rank alone) and the load proper (which may be
collective, like DCP's).  When any rank fails, all ranks move on to the next candidate
together: no rank ever falls back alone, so the collectives of a load always match.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from dlrover_hpc.checkpoint.env import BUFFERS
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

#: what a failed read raises (a torch.distributed.checkpoint error is wrapped by its caller)
RESTORE_ERRORS = (
    CheckpointError,
    OSError,
    ValueError,
    RuntimeError,
    KeyError,
    TypeError,
    pickle.UnpicklingError,
)

#: the load proper, returning the state and the token of the save it came from
Load = Callable[[], tuple[Any, int]]
#: local preparation of a load from (source, step); raises when this rank cannot load it
Prepare = Callable[["Source", int], Load]


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Holdings:
    """What one rank can restore from."""

    #: step -> save token of each complete step in this rank's shared memory
    memory: Mapping[int, int]
    #: the newest committed step this rank sees on storage (-1: none)
    newest_committed: int
    #: this rank's generation token
    token: int

    def encode(self) -> list[int]:
        """Fixed-length integers for one all_gather: token, committed, (step, token) x2."""
        newest = sorted(self.memory, reverse=True)[: len(BUFFERS)]
        pairs = [[s, self.memory[s]] for s in newest]
        pairs += [[-1, -1]] * (len(BUFFERS) - len(pairs))
        return [self.token, self.newest_committed, *(v for pair in pairs for v in pair)]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Holdings:
        token, committed, *rest = values
        memory = {rest[i]: rest[i + 1] for i in range(0, len(rest), 2) if rest[i] >= 0}
        return cls(memory=memory, newest_committed=committed, token=token)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """Where every rank restores from first, and where they all go when that fails."""

    source: Source
    step: int
    #: the generation token all ranks save with from now on
    token: int
    #: the newest step every rank may find committed on storage (-1: none)
    storage_step: int


def plan_restore(ranks: Sequence[Holdings]) -> Choice:
    """The restore every rank chooses from the gathered holdings of all ranks (pure)."""
    newest = [max(h.memory, default=-1) for h in ranks]
    mem_max, mem_min = max(newest), min(newest)
    saves = {h.memory.get(mem_min) for h in ranks}
    if None in saves or len(saves) != 1:  # not held by all, or from different saves
        mem_min = -1
    committed = [h.newest_committed for h in ranks]
    source, step = decide(
        mem_max=mem_max, mem_min=mem_min, all_hold_min=mem_min >= 0, committed_max=max(committed)
    )
    storage_step = min(committed)
    if source == Source.STORAGE:
        step = storage_step
        source = Source.STORAGE if step >= 0 else Source.NONE
    return Choice(
        source=source, step=step, token=max(h.token for h in ranks), storage_step=storage_step
    )


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

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values` (all of one length), in rank order."""
        if not self.active:
            return [list(values)]
        assert self._dist is not None
        mine = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._dist.all_gather(out, mine)
        return [[int(v) for v in t.tolist()] for t in out]

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


def choose(agreement: Agreement, mine: Holdings) -> Choice:
    """One collective: the choice every rank makes from every rank's holdings."""
    return plan_restore([Holdings.decode(v) for v in agreement.gather(mine.encode())])


def next_candidate(agreement: Agreement, local: Iterable[int], below: int) -> int:
    """The next step to try below `below` that every rank proposes (-1 when none)."""
    mine = max((s for s in local if s < below), default=-1)
    return -agreement.max([-mine])[0]


def restore_agreed(
    agreement: Agreement, choice: Choice, committed: Iterable[int], prepare: Prepare
) -> tuple[Source, int, Any]:
    """Loads the chosen step, else steps back together with the other ranks (the memory step
    falls back to storage; a storage step to the next older committed one) until every rank
    succeeds; returns (source, step, state), or (NONE, -1, None)."""
    steps = sorted(set(committed), reverse=True)
    source, step = choice.source, choice.step
    while source != Source.NONE:
        loaded, result = _attempt(agreement, prepare, source, step)
        if loaded:
            return source, step, result
        if source == Source.MEMORY:
            source, step = Source.STORAGE, choice.storage_step
        else:
            step = next_candidate(agreement, steps, step)
        if step < 0:
            source = Source.NONE
    return Source.NONE, -1, None


def _attempt(agreement: Agreement, prepare: Prepare, source: Source, step: int) -> tuple[bool, Any]:
    """One agreed try: the same number of collectives on every rank, whatever fails where."""
    load: Load | None = None
    error: BaseException | None = None
    try:
        load = prepare(source, step)
    except RESTORE_ERRORS as exc:
        error = exc
    if agreement.all(error is None):
        assert load is not None
        result: Any = None
        signature = -1
        try:
            result, signature = load()
        except RESTORE_ERRORS as exc:
            error = exc
        failed, high, neg_low = agreement.max([int(error is not None), signature, -signature])
        if not failed and high == -neg_low:
            return True, result
        if not failed:
            error = CheckpointError(f"the ranks' parts of step {step} come from different saves")
    logger.warning(
        "checkpoint restore_step_unusable source=%s step=%d error=%s: every rank moves on "
        "to the next candidate together",
        source.value,
        step,
        error if error is not None else "another rank could not load it",
    )
    return False, None
