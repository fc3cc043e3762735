"""Restore agreement: every rank restores the same step, from memory, a peer or storage.

One collective gathers what each rank holds and needs: the parts of steps in its node's shared
memory (each with the token of the save that wrote it, which part it is and how many parts
its step has), the part it needs in this world, and the newest committed step it sees on
storage.  Every rank then computes the same `Choice` from the same values (`plan_restore`,
pure).

Memory is chosen for the newest step, not older than storage's newest committed one, of which
some rank holds every part the world needs, all from one save.  A rank that holds its part
restores from memory (`MEMORY`); a rank that lacks it (a new node, a node whose ranks moved)
receives it from a holder over the process group (`PEER`, `peer_transfer`); storage is used
only when no such step exists.  After a membership change this keeps a restore in memory
while the surviving nodes hold the parts: for replicated (DDP) state any one copy will do;
for sharded state every rank's part must survive somewhere, and the world must have the size
it was saved with, because memory holds each rank's shard as it was cut.  Resharding to
another world size is left to storage (where DCP plans it): such a step is never a memory
candidate.

A restore then tries candidates in an agreed order, the memory step first when chosen, then
committed steps newest first.  Each try has two phases with a vote after each: `prepare`
(local: open, map, verify; it may fail on one rank alone) and the load proper (collective:
the peer transfers, then the load, like DCP's).  When any rank fails, all ranks move on to the
next candidate together: no rank ever falls back alone, so the collectives of a load always
match.

A loaded state is then checked on every rank (`restore_check`: non-finite tensors, the user's
`validate`), inside the same vote.  A state rejected on any rank is never trained on: every
rank moves to the next *older* step (the same step elsewhere holds the same bytes), from
memory when some rank still holds every part of one (a node's second buffer keeps the step
before its newest) and it is not older than the newest committed step below, else from
storage; each rejection is reported (`Rejection`).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import heapq
import logging
import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import torch

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
#: local preparation of a load from (source, step, the memory plan in force); raises when
#: this rank cannot load it
Prepare = Callable[["Source", int, "Choice"], Load]
#: why this rank rejects a loaded state (None: it passes); `restore_check.RestoreCheck`
Check = Callable[[Any], "str | None"]


class Source(enum.Enum):
    """Where a rank's restored state came from (the `source` of `checkpoint_restored`)."""

    #: its node's shared memory
    MEMORY = "memory"
    #: another rank's shared memory, sent over the process group
    PEER = "peer"
    STORAGE = "storage"
    #: its node's local tier (--local-ckpt-dir): the agreed storage step, read from local disk
    LOCAL = "local"
    NONE = "none"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """One part of a step, held complete in a node's shared memory."""

    step: int
    #: the generation token of the save that wrote it
    token: int
    #: which part: the rank that saved it (sharded state); 0 for replicated state
    part: int
    #: how many parts its step has: the world size that saved it (sharded); 1 (replicated)
    parts: int
    #: the bytes of its segment that a peer transfer sends
    nbytes: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.step, self.token, self.part, self.parts)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Holdings:
    """What one rank can restore from, and what it needs."""

    #: the parts in its node's shared memory (its own segments and others' on the node)
    memory: tuple[Part, ...]
    #: the newest committed step this rank sees on storage (-1: none)
    newest_committed: int
    #: this rank's generation token
    token: int
    #: the part this rank restores and how many parts a step has in this world:
    #: (rank, world size) for sharded state, (0, 1) for replicated state
    need: tuple[int, int] = (0, 1)

    def encode(self) -> list[int]:
        """Integers for one all_gather: token, committed, need, count, then 5 per part."""
        fields = [(p.step, p.token, p.part, p.parts, p.nbytes) for p in self.memory]
        head = [self.token, self.newest_committed, *self.need, len(fields)]
        return head + [v for row in fields for v in row]

    @classmethod
    def decode(cls, values: Sequence[int]) -> Holdings:
        """The inverse of `encode`; ignores padding after the parts."""
        token, committed, part, parts, count, *rest = values
        memory = tuple(
            Part(step=s, token=t, part=p, parts=n, nbytes=b)
            for s, t, p, n, b in (rest[i : i + 5] for i in range(0, 5 * count, 5))
        )
        return cls(memory=memory, newest_committed=committed, token=token, need=(part, parts))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """A part a rank that holds it sends to a rank that needs it."""

    src: int
    dst: int
    part: int
    parts: int
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Choice:
    """Where every rank restores from first, and where they all go when that fails."""

    #: MEMORY: the step comes from shared memory (on some ranks through a peer)
    source: Source
    step: int
    #: the generation token all ranks save with from now on
    token: int
    #: the newest step every rank may find committed on storage (-1: none)
    storage_step: int
    #: the token of the save the memory step comes from (-1: not from memory)
    save: int = -1
    #: the parts sent to the ranks that lack them (memory step only)
    transfers: tuple[Transfer, ...] = ()

    def source_of(self, rank: int) -> Source:
        """This rank's own source for the first try: PEER when it receives its part."""
        if self.source == Source.MEMORY and self.fetch(rank) is not None:
            return Source.PEER
        return self.source

    def fetch(self, rank: int) -> Transfer | None:
        return next((t for t in self.transfers if t.dst == rank), None)

    def sends(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src == rank]


def memory_step(
    ranks: Sequence[Holdings], committed_max: int, *, below: int | None = None
) -> tuple[int, int] | None:
    """The newest (step, save token), not older than `committed_max` (and older than
    `below`, when given), of which some rank holds every part some rank needs (pure); None
    when no step qualifies.

    Saves are tried newest step first; two saves of one step (a rollback that saved it again)
    are tried in token order, the same on every rank.  Parts of different saves never mix."""
    held = {p.key for h in ranks for p in h.memory}
    needed = {h.need for h in ranks}
    for step, save in sorted({p.key[:2] for h in ranks for p in h.memory}, reverse=True):
        if below is not None and step >= below:
            continue
        if step < committed_max:
            break
        if all((step, save, *need) in held for need in needed):
            return step, save
    return None


def assign_senders(ranks: Sequence[Holdings], step: int, save: int) -> tuple[Transfer, ...]:
    """Who sends each rank that lacks its part of (step, save) (pure): among the part's
    holders, the one with the fewest bytes to send so far (the lowest rank on a tie), so a
    new node's ranks draw on every surviving node rather than all on the first.  One heap of
    holders per part keeps this near-linear in the number of ranks."""
    holders: dict[tuple[int, int], list[tuple[int, int]]] = collections.defaultdict(list)
    size: dict[tuple[int, int, int], int] = {}  # (part, parts, holder): its segment's bytes
    for rank, h in enumerate(ranks):
        for p in h.memory:
            if p.key[:2] == (step, save):
                holders[(p.part, p.parts)].append((0, rank))
                size[(p.part, p.parts, rank)] = p.nbytes
    sent: collections.Counter[int] = collections.Counter()
    transfers = []
    for rank, mine in enumerate(ranks):
        heap = holders[mine.need]
        if any(p.key == (step, save, *mine.need) for p in mine.memory):
            continue
        while heap[0][0] != sent[heap[0][1]]:  # its count grew by sends of another part
            heapq.heapreplace(heap, (sent[heap[0][1]], heap[0][1]))
        src = heap[0][1]
        part, parts = mine.need
        nbytes = size[(part, parts, src)]  # copies differ in their meta (pid, time)
        sent[src] += nbytes
        heapq.heapreplace(heap, (sent[src], src))
        transfers.append(Transfer(src=src, dst=rank, part=part, parts=parts, nbytes=nbytes))
    return tuple(transfers)


def plan_older(
    ranks: Sequence[Holdings], *, below: int, storage_next: int, token: int
) -> Choice | None:
    """After the state of step `below` was rejected: the memory plan of the newest older
    step some rank holds every part of, when it is not older than `storage_next` (the next
    committed step every rank proposes); None when storage's is the next one (pure)."""
    found = memory_step(ranks, storage_next, below=below)
    if found is None:
        return None
    step, save = found
    return Choice(
        source=Source.MEMORY,
        step=step,
        token=token,
        storage_step=storage_next,
        save=save,
        transfers=assign_senders(ranks, step, save),
    )


def plan_restore(ranks: Sequence[Holdings]) -> Choice:
    """The restore every rank chooses from the gathered holdings of all ranks (pure)."""
    committed = [h.newest_committed for h in ranks]
    token = max(h.token for h in ranks)
    storage_step = min(committed)
    found = memory_step(ranks, max(committed))
    if found is not None:
        step, save = found
        return Choice(
            source=Source.MEMORY,
            step=step,
            token=token,
            storage_step=storage_step,
            save=save,
            transfers=assign_senders(ranks, step, save),
        )
    source = Source.STORAGE if storage_step >= 0 else Source.NONE
    return Choice(source=source, step=storage_step, token=token, storage_step=storage_step)


class Agreement:
    """Collectives for the restore decision; trivial without torch.distributed."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist if dist.is_available() and dist.is_initialized() else None
        self.world = self._dist.get_world_size() if self._dist else 1
        self.rank = self._dist.get_rank() if self._dist else 0

    @property
    def active(self) -> bool:
        return self._dist is not None and self.world > 1

    @property
    def dist(self) -> Any:
        """torch.distributed when a process group of more than one rank is up, else None."""
        return self._dist if self.active else None

    def device(self) -> torch.device:
        """Where the backend's tensors live: the current GPU for NCCL, else the CPU."""
        if self._dist is not None and self._dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def gather(self, values: Sequence[int]) -> list[list[int]]:
        """Every rank's `values`, in rank order; the lists may differ in length (they come
        back padded with -1 to the longest)."""
        if not self.active:
            return [list(values)]
        assert self._dist is not None
        longest = self.max([len(values)])[0]
        padded = [*values, *([-1] * (longest - len(values)))]
        mine = torch.tensor(padded, dtype=torch.int64, device=self.device())
        out = [torch.empty_like(mine) for _ in range(self.world)]
        self._dist.all_gather(out, mine)
        return [[int(v) for v in t.tolist()] for t in out]

    def max(self, values: Iterable[int]) -> list[int]:
        vals = list(values)
        if not self.active:
            return vals
        assert self._dist is not None
        t = torch.tensor(vals, dtype=torch.int64, device=self.device())
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def all(self, flag: bool) -> bool:
        return -self.max([-int(bool(flag))])[0] == 1


def gather_holdings(agreement: Agreement, mine: Holdings) -> list[Holdings]:
    """Two collectives: every rank's holdings, in rank order."""
    return [Holdings.decode(v) for v in agreement.gather(mine.encode())]


def choose(agreement: Agreement, mine: Holdings) -> Choice:
    """Two collectives: the choice every rank makes from every rank's holdings."""
    return plan_restore(gather_holdings(agreement, mine))


def next_candidate(agreement: Agreement, local: Iterable[int], below: int) -> int:
    """The next step to try below `below` that every rank proposes (-1 when none)."""
    mine = max((s for s in local if s < below), default=-1)
    return -agreement.max([-mine])[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A step whose loaded state failed the check on some rank (every rank knows of it)."""

    step: int
    #: this rank's source of the rejected try
    source: Source
    #: the lowest rank that rejected it
    by_rank: int
    #: this rank's reason; None when only other ranks rejected it
    why: str | None
    #: the token of the rejected save (a memory step); -1 for a step from storage
    save: int
    #: what every rank tries next: (source, step); (NONE, -1) when nothing is left
    next_source: Source
    next_step: int


class Restored(NamedTuple):
    """What the agreed restore loaded: this rank's source, the step, the state, and the
    memory plan the step came from (its `save`; the first choice for storage)."""

    source: Source
    step: int
    result: Any
    plan: Choice


def restore_agreed(
    agreement: Agreement,
    choice: Choice,
    committed: Iterable[int],
    prepare: Prepare,
    *,
    check: Check | None = None,
    ranks: Sequence[Holdings] = (),
    on_rejected: Callable[[Rejection], None] | None = None,
) -> Restored:
    """Loads the chosen step, else steps back together with the other ranks (the memory step
    falls back to storage; a storage step to the next older committed one) until every rank
    succeeds; returns (this rank's source, step, state, plan), or (NONE, -1, None, choice).
    `prepare` is called with PEER on the ranks that receive their part of a memory step.

    With `check`, a loaded state that any rank rejects sends every rank to the next older
    step: from memory when `ranks` (the gathered holdings) show one (`plan_older`), else from
    storage; `on_rejected` hears of each rejection."""
    steps = sorted(set(committed), reverse=True)
    plan, source, step = choice, choice.source, choice.step
    while source != Source.NONE:
        mine = plan.source_of(agreement.rank) if source == Source.MEMORY else source
        outcome = _attempt(agreement, prepare, mine, step, plan, check)
        if outcome.loaded:
            return Restored(mine, step, outcome.result, plan)
        rejected, save = step, plan.save if source == Source.MEMORY else -1
        if outcome.rejected_by is not None:
            storage_next = next_candidate(agreement, steps, step)
            older = plan_older(ranks, below=step, storage_next=storage_next, token=choice.token)
            if older is not None:
                plan, source, step = older, Source.MEMORY, older.step
            else:
                source, step = Source.STORAGE, storage_next
        elif source == Source.MEMORY:
            source = Source.STORAGE  # the same step, or the newest committed before it
            if plan is not choice:
                step = next_candidate(agreement, steps, step + 1)
            else:
                step = choice.storage_step
        else:
            step = next_candidate(agreement, steps, step)
        if step < 0:
            source = Source.NONE
        if outcome.rejected_by is not None and on_rejected is not None:
            on_rejected(
                Rejection(
                    step=rejected,
                    source=mine,
                    by_rank=outcome.rejected_by,
                    why=outcome.why,
                    save=save,
                    next_source=source,
                    next_step=step if source != Source.NONE else -1,
                )
            )
    return Restored(Source.NONE, -1, None, choice)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Outcome:
    loaded: bool
    result: Any = None
    #: the lowest rank that rejected the loaded state (None: no rank did)
    rejected_by: int | None = None
    #: this rank's reason for rejecting it
    why: str | None = None


def _attempt(
    agreement: Agreement,
    prepare: Prepare,
    source: Source,
    step: int,
    plan: Choice,
    check: Check | None,
) -> _Outcome:
    """One agreed try: the same number of collectives on every rank, whatever fails where."""
    load: Load | None = None
    error: BaseException | None = None
    try:
        load = prepare(source, step, plan)
    except RESTORE_ERRORS as exc:
        error = exc
    if agreement.all(error is None):
        assert load is not None
        result: Any = None
        signature = -1
        why: str | None = None
        try:
            result, signature = load()
        except RESTORE_ERRORS as exc:
            error = exc
        if error is None and check is not None:
            try:
                why = check(result)
            except Exception as exc:  # a rank that raised here would leave the others waiting
                logger.exception("checkpoint restore_check_failed step=%d", step)
                why = f"the check itself failed: {type(exc).__name__}: {exc}"
        world, rank = agreement.world, agreement.rank
        failed, neg_by, high, neg_low = agreement.max(
            [int(error is not None), -(rank if why is not None else world), signature, -signature]
        )
        if -neg_by < world:
            logger.warning(
                "checkpoint restore_rejected source=%s step=%d rank=%d why=%s: every rank "
                "moves on to an older step together",
                source.value,
                step,
                -neg_by,
                why if why is not None else "another rank rejected it",
            )
            return _Outcome(loaded=False, rejected_by=-neg_by, why=why)
        if not failed and high == -neg_low:
            return _Outcome(loaded=True, result=result)
        if not failed:
            error = CheckpointError(f"the ranks' parts of step {step} come from different saves")
    logger.warning(
        "checkpoint restore_step_unusable source=%s step=%d error=%s: every rank moves on "
        "to the next candidate together",
        source.value,
        step,
        error if error is not None else "another rank could not load it",
    )
    return _Outcome(loaded=False)
