"""Segments: node ranks in groups of N nodes, a group never straddling a block (pure).

With ``--segment N`` a rendezvous round admits whole segments only. A segment is N waiting
nodes of one block (an NVLink domain of Slurm's block plugin, or a leaf switch of a tree
topology; with no topology file the whole job is one block). Node ranks follow the topology
order (blocks contiguous, see ``dlrover_hpc.topology.order``) and each block contributes a
multiple of N nodes, so ranks ``k*N .. k*N+N-1`` always lie in one block.

Which segments a round takes (:func:`choose_segments`), so that a spare replaces a lost node
only inside the lost node's block:

1. in each block, the previous round's nodes come first, then the block's other waiting nodes
   (spares), each in rank order; the block is cut into ``len // N`` segments and the rest wait;
2. segments holding more of the previous round's nodes go first, then block order.

So a block that lost a node refills its segment from its own free node when it has one; when it
has none, its remaining nodes cannot form a segment and a segment of another block (made of
spares) takes the place: the segment moves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A waiting agent as segments see it."""

    agent_id: str
    block: str  # "" for a node the topology does not name (they form one block, last)
    order: int  # position in the topology's rank order of the waiting nodes
    was_active: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    block: str
    members: tuple[str, ...]  # agent ids
    kept: int  # how many were in the previous round


def form_segments(candidates: Sequence[Candidate], size: int) -> list[Segment]:
    """Every whole segment the candidates can form, best first (see the module docstring)."""
    by_block: dict[str, list[Candidate]] = {}
    for c in sorted(candidates, key=lambda c: c.order):
        by_block.setdefault(c.block, []).append(c)
    ranked: list[tuple[int, int, int, Segment]] = []
    for block_pos, (block, members) in enumerate(by_block.items()):
        members.sort(key=lambda c: (not c.was_active, c.order))
        for i in range(len(members) // size):
            group = members[i * size : (i + 1) * size]
            kept = sum(c.was_active for c in group)
            segment = Segment(block=block, members=tuple(c.agent_id for c in group), kept=kept)
            ranked.append((-kept, block_pos, i, segment))
    ranked.sort(key=lambda r: r[:3])
    return [r[3] for r in ranked]


def segment_capacity(candidates: Sequence[Candidate], size: int) -> int:
    """How many candidates whole segments can hold."""
    per_block: dict[str, int] = {}
    for c in candidates:
        per_block[c.block] = per_block.get(c.block, 0) + 1
    return sum(n // size * size for n in per_block.values())


def choose_segments(candidates: Sequence[Candidate], size: int, count: int) -> tuple[str, ...]:
    """The agent ids of the best ``count // size`` segments."""
    chosen = form_segments(candidates, size)[: count // size]
    return tuple(agent for segment in chosen for agent in segment.members)


def split_segments(blocks: Sequence[str], size: int) -> list[tuple[int, ...]]:
    """Node ranks (0..n-1, in rank order) cut into segments of ``size``; ``blocks`` holds each
    rank's block. Raises ValueError where a segment would straddle a block (a broken round)."""
    out: list[tuple[int, ...]] = []
    for start in range(0, len(blocks), size):
        ranks = tuple(range(start, min(start + size, len(blocks))))
        if len(ranks) < size or len({blocks[r] for r in ranks}) != 1:
            raise ValueError(
                f"node ranks {ranks[0]}..{ranks[-1]} do not form one segment of {size} in one"
                f" block (blocks: {', '.join(blocks[r] or '-' for r in ranks)})"
            )
        out.append(ranks)
    return out
