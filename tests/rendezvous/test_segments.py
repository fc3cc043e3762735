"""Segments (--segment N): whole segments per block, spares by block, the segment that moves."""

from __future__ import annotations

import pytest

from dlrover_hpc import topology as topo
from dlrover_hpc.config import NodeRange, check_segment
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.rendezvous.ranking import RankInput, block_places, segment_gain
from dlrover_hpc.rendezvous.segments import (
    Candidate,
    choose_segments,
    form_segments,
    segment_capacity,
    split_segments,
)
from dlrover_hpc.rendezvous.state import DecisionKind, RdzvParams, Waiter, decide, usable_count

pytestmark = pytest.mark.timeout(60)

BLOCKS = topo.loads(
    "BlockName=b1 Nodes=n[1-4]\nBlockName=b2 Nodes=n[5-8]\nBlockName=b3 Nodes=n[9-10]\n"
    "BlockSizes=4\n"
)


def cands(spec: str) -> list[Candidate]:
    """'n1* n2 n5*': waiting nodes, * for the previous round's; blocks from BLOCKS."""
    names = [w.rstrip("*") for w in spec.split()]
    places = block_places([RankInput(agent_id=n, node=n) for n in names], BLOCKS)
    return [
        Candidate(agent_id=n, block=places[n][0], order=places[n][1], was_active=w.endswith("*"))
        for n, w in zip(names, spec.split(), strict=True)
    ]


@pytest.mark.parametrize(
    ("waiting", "size", "count", "chosen"),
    [
        # a fresh round: segments in block order, never across a block
        ("n1 n2 n3 n4 n5 n6 n9", 2, 6, "n1 n2 n3 n4 n5 n6"),
        ("n1 n2 n3 n5 n6 n7 n9", 2, 4, "n1 n2 n5 n6"),
        # n3 (b1) lost; b1's spare n4 replaces it, though b2's n5 n6 wait too
        ("n1* n2* n4 n5 n6 n7* n8*", 2, 4, "n1 n2 n7 n8"),
        ("n1* n4 n5 n6 n7* n8*", 2, 4, "n1 n4 n7 n8"),
        # n2 lost and b1 has no free node: the segment moves to b3's spares
        ("n1* n7* n8* n9 n10", 2, 4, "n7 n8 n9 n10"),
        # segments of 4: b1 keeps its three and takes its own spare n4
        ("n1* n2* n3* n4 n5 n6 n7 n8", 4, 4, "n1 n2 n3 n4"),
        # b1 lost two of its four: b2's four spares form the segment instead
        ("n1* n2* n5 n6 n7 n8", 4, 4, "n5 n6 n7 n8"),
        # a node outside the topology is a block of its own ("") and goes last
        ("x1 x2 n1", 2, 2, "x1 x2"),
    ],
)
def test_choose_segments(waiting: str, size: int, count: int, chosen: str) -> None:
    got = choose_segments(cands(waiting), size, count)
    assert set(got) == set(chosen.split())
    assert len(got) == count


@pytest.mark.parametrize(
    ("waiting", "size", "capacity"),
    [
        ("n1 n2 n3 n5 n6 n7 n9", 2, 4),
        ("n1 n2 n3 n5 n6 n7 n9", 3, 6),
        ("n1 n2 n3 n5 n6 n7 n9", 4, 0),
        ("n1 n5 n9", 2, 0),
    ],
)
def test_segment_capacity(waiting: str, size: int, capacity: int) -> None:
    assert segment_capacity(cands(waiting), size) == capacity


def test_segments_keep_the_previous_rounds_nodes_together() -> None:
    segments = form_segments(cands("n1* n2 n3* n4"), 2)
    assert [s.members for s in segments] == [("n1", "n3"), ("n2", "n4")]
    assert [s.kept for s in segments] == [2, 0]


def waiters(spec: str) -> list[Waiter]:
    return [
        Waiter(agent_id=c.agent_id, joined_at=0.0, was_active=c.was_active, block=c.block,
               order=c.order)
        for c in cands(spec)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("waiting", "params", "initial", "now", "kind", "chosen"),
    [
        # 2:4 in segments of 2: five nodes in three blocks hold two segments
        ("n1 n2 n5 n6 n9", RdzvParams(min_nodes=2, max_nodes=4, segment=2), True, 0.1,
         DecisionKind.COMPLETE, "n1 n2 n5 n6"),
        # one node of each block: no segment at all, so no round however many wait
        ("n1 n5 n9", RdzvParams(min_nodes=2, max_nodes=4, segment=2), True, 5.0,
         DecisionKind.WAIT, ""),
        # MIN reached in whole segments: the last call runs (MAX not filled) ...
        ("n1 n2 n5", RdzvParams(min_nodes=2, max_nodes=4, segment=2), True, 1.0,
         DecisionKind.WAIT, ""),
        # ... and ends with the one segment
        ("n1 n2 n5", RdzvParams(min_nodes=2, max_nodes=4, segment=2), True, 3.5,
         DecisionKind.COMPLETE, "n1 n2"),
        # n1..n4 ran, n2 was lost and b1 has no free node: one of b1's segments moves to
        # b2's spares, and b1's odd node waits as a spare
        ("n1* n3* n4* n6 n7", RdzvParams(min_nodes=4, max_nodes=4, segment=2), False, 0.1,
         DecisionKind.COMPLETE, "n1 n3 n6 n7"),
    ],
)  # fmt: skip
def test_decide_with_segments(
    waiting: str, params: RdzvParams, initial: bool, now: float, kind: DecisionKind, chosen: str
) -> None:
    w = waiters(waiting)
    d = decide(params=params, waiting=w, alive=len(w), initial=initial, opened_at=0.0, now=now)
    assert d.kind is kind
    assert set(d.chosen) == set(chosen.split())


def test_ranks_of_a_segmented_round_never_straddle_a_block() -> None:
    w = waiters("n1 n2 n3 n5 n6 n7 n9 n10")
    d = decide(
        params=RdzvParams(min_nodes=6, max_nodes=6, segment=2),
        waiting=w,
        alive=len(w),
        initial=True,
        opened_at=0.0,
        now=0.1,
    )
    places = block_places([RankInput(agent_id=a, node=a) for a in d.chosen], BLOCKS)
    ranked = sorted(places, key=lambda a: places[a][1])
    assert ranked == ["n1", "n2", "n5", "n6", "n9", "n10"]
    assert split_segments([places[a][0] for a in ranked], 2) == [(0, 1), (2, 3), (4, 5)]
    with pytest.raises(ValueError, match=r"node ranks 2\.\.3 do not form one segment"):
        split_segments(["b1", "b1", "b1", "b2"], 2)


@pytest.mark.parametrize(
    ("segment", "unit", "nnodes", "error"),
    [
        (1, 1, "1:4", None),
        (2, 1, "2:4", None),
        (4, 2, "4:4", None),
        (0, 1, "1:4", "--segment=0: must be at least 1 (1: no segments)"),
        (3, 1, "2:2", "--segment=3 with --nnodes=2:2: no multiple of 3 lies between 2 and 2"),
        (3, 2, "4:5", "--segment=3 and --node-unit=2 with --nnodes=4:5: no multiple of 6"),
    ],
)
def test_check_segment(segment: int, unit: int, nnodes: str, error: str | None) -> None:
    if error is None:
        check_segment(segment, unit, NodeRange.parse(nnodes))
        assert usable_count(RdzvParams(min_nodes=1, max_nodes=8, segment=segment), 7) % segment == 0
        return
    with pytest.raises(ConfigError) as info:
        check_segment(segment, unit, NodeRange.parse(nnodes))
    assert str(info.value).startswith(error)


@pytest.mark.parametrize(
    ("running", "waiting", "size", "gain"),
    [
        ("n1 n2", "n3 n5", 2, 0),  # b1's odd node and a lone b2 node: no new segment
        ("n1 n2", "n3 n5 n6", 2, 2),  # b2 now holds one
        ("n1 n2", "n3 n4", 2, 2),  # b1 grows by a segment of its own
        ("n1 n2 n3 n4", "n5 n6 n7", 4, 0),  # segments of 4: b2 is one node short
    ],
)
def test_segment_gain(running: str, waiting: str, size: int, gain: int) -> None:
    def inputs(spec: str) -> list[RankInput]:
        return [RankInput(agent_id=n, node=n) for n in spec.split()]

    assert segment_gain(inputs(running), inputs(waiting), BLOCKS, size) == gain
