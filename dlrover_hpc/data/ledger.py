"""Dynamic data sharding, the master's side: which samples of a dataset are trained, handed
out, or still to do — exactly once per epoch, across failures and world-size changes.

A dataset of ``size`` samples is read in ``epochs`` passes; each pass in shards of at most
``shard_size`` consecutive positions (the client maps a position to a sample, e.g. through a
seeded permutation of the epoch).  Every rank reads its shards in the order it got them, one
batch of ``batch_size`` samples per step, and all ranks of a round step together.

A **round** is one incarnation of the workers.  It starts at batch ``start`` (the number of
batches each rank had drawn at the checkpoint it restored, 0 for a fresh job).  A later round
that starts at batch ``s`` rolls the model back to ``s``: whatever any earlier round drew at or
after ``s`` never reached the model.  So a round's *surviving* batches are those before the
smallest start of any later round, and a rank's surviving samples are the first
``surviving batches x batch_size`` of its stream.  Everything else it was handed goes back to
be done again — the rest of a shard included, split where the rank stopped.  The ledger keeps
only the hand-outs and the round starts (journaled by the master) and derives the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

Range = tuple[int, int, int]  # (epoch, start, end): positions [start, end) of an epoch


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    size: int
    shard_size: int
    epochs: int = 1

    def __post_init__(self) -> None:
        for name in ("size", "shard_size", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")


@dataclasses.dataclass(frozen=True, slots=True)
class HandOut:
    round: int
    rank: int
    epoch: int
    start: int
    end: int
    offset: int  # samples the rank was handed in this round before this shard


@dataclasses.dataclass(frozen=True, slots=True)
class RoundStart:
    round: int
    start: int  # batches each rank had drawn at the restored checkpoint
    batch_size: int


class Ledger:
    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.rounds: dict[int, RoundStart] = {}
        self.handouts: list[HandOut] = []
        self._todo: list[Range] | None = None  # derived; None: derive again
        self._streamed: dict[tuple[int, int], int] = {}  # (round, rank) -> samples handed

    # ------------------------------------------------------------------ records
    def start_round(self, round: int, *, start: int, batch_size: int) -> RoundStart:
        """The first request of ``round`` says where its workers resumed; later ones agree."""
        known = self.rounds.get(round)
        if known is not None:
            return known
        if batch_size < 1 or start < 0:
            raise ValueError(f"round {round}: batch_size {batch_size} and start {start} invalid")
        if self.rounds and round < max(self.rounds):
            raise ValueError(f"round {round} is older than round {max(self.rounds)}")
        rs = RoundStart(round, start, batch_size)
        self.rounds[round] = rs
        self._todo = None
        return rs

    def next(self, round: int, rank: int) -> HandOut | None:
        """The next shard for ``rank`` of the current ``round``; None when every sample of
        every epoch is trained or handed out."""
        if round not in self.rounds or round != max(self.rounds):
            raise ValueError(
                f"round {round} is not the current round {max(self.rounds, default=0)}"
            )
        todo = self.todo()
        if not todo:
            return None
        epoch, start, end = todo[0]
        end = min(end, start + self.spec.shard_size)
        offset = self._streamed.get((round, rank), 0)
        h = HandOut(round, rank, epoch, start, end, offset)
        self._add(h)
        if end == todo[0][2]:
            todo.pop(0)
        else:
            todo[0] = (epoch, end, todo[0][2])
        return h

    def _add(self, h: HandOut) -> None:
        self.handouts.append(h)
        key = (h.round, h.rank)
        self._streamed[key] = max(self._streamed.get(key, 0), h.offset + h.end - h.start)

    # ------------------------------------------------------------------ derived
    def surviving_batches(self, round: int) -> int | None:
        """Batches of ``round`` that reached the model (None: the current round, open)."""
        later = [r.start for n, r in self.rounds.items() if n > round]
        if not later:
            return None
        return max(0, min(later) - self.rounds[round].start)

    def trained(self) -> list[Range]:
        """Positions the model has trained, by the rounds that are over (merged, sorted)."""
        out: list[Range] = []
        for h in self.handouts:
            kept = self._kept(h)
            if kept is not None and kept > 0:
                out.append((h.epoch, h.start, h.start + kept))
        return _merge(out)

    def in_flight(self) -> list[Range]:
        """Positions handed to the current round."""
        return _merge([(h.epoch, h.start, h.end) for h in self.handouts if self._kept(h) is None])

    def _kept(self, h: HandOut) -> int | None:
        """How many of ``h``'s samples survived (None: its round is still running)."""
        batches = self.surviving_batches(h.round)
        if batches is None:
            return None
        consumed = batches * self.rounds[h.round].batch_size
        return max(0, min(h.end - h.start, consumed - h.offset))

    def todo(self) -> list[Range]:
        """Positions still to hand out, lowest epoch first."""
        if self._todo is None:
            taken = _merge(self.trained() + self.in_flight())
            self._todo = _subtract([(e, 0, self.spec.size) for e in range(self.spec.epochs)], taken)
        return self._todo

    def finished(self) -> bool:
        return not self.todo() and not self.in_flight()

    # ------------------------------------------------------------------ journal
    def to_records(self) -> dict[str, Any]:
        return {
            "spec": dataclasses.asdict(self.spec),
            "rounds": [dataclasses.astuple(r) for r in self.rounds.values()],
            "handouts": [dataclasses.astuple(h) for h in self.handouts],
        }

    @classmethod
    def from_records(cls, rec: dict[str, Any]) -> Ledger:
        ledger = cls(Spec(**rec["spec"]))
        for r in rec.get("rounds", []):
            ledger.rounds[int(r[0])] = RoundStart(*map(int, r))
        for h in rec.get("handouts", []):
            ledger._add(HandOut(*map(int, h)))
        return ledger


def _merge(ranges: Iterable[Range]) -> list[Range]:
    out: list[Range] = []
    for e, s, t in sorted(ranges):
        if t <= s:
            continue
        if out and out[-1][0] == e and s <= out[-1][2]:
            out[-1] = (e, out[-1][1], max(out[-1][2], t))
        else:
            out.append((e, s, t))
    return out


def _subtract(whole: Sequence[Range], taken: Sequence[Range]) -> list[Range]:
    out: list[Range] = []
    for e, s, t in whole:
        cursor = s
        for te, ts, tt in taken:
            if te != e or tt <= cursor or ts >= t:
                continue
            if ts > cursor:
                out.append((e, cursor, ts))
            cursor = max(cursor, tt)
        if cursor < t:
            out.append((e, cursor, t))
    return out
