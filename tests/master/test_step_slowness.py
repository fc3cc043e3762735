"""Stragglers counted in steps and slow links from TCP round trips: the pure rules (issue 50)."""

from __future__ import annotations

import collections

import pytest

from dlrover_hpc.master import link_slowness as ls
from dlrover_hpc.master import step_slowness as ss
from dlrover_hpc.master.slowness import Slow


@pytest.mark.parametrize(
    ("ratios", "factor", "steps"),
    [
        ([1.4], 2.0, 30),  # at the weak factor: EVIDENCE_STEPS
        ([1.5], 2.0, 24),  # a node at 2/3 speed
        ([2.0, 1.9, 2.1], 2.0, 12),  # at half speed: the median's excess, 1.0
        ([4.0], 2.0, ss.MIN_EVIDENCE_STEPS),  # a quarter speed: the floor
        ([2.0, 40.0, 2.0], 2.0, 12),  # one wild check does not shorten it
        ([1.0], 2.0, 1 << 30),  # not slow at all: never
        ([], 2.0, 1 << 30),
        ([2.2], 3.0, 20),  # --straggler-factor 3: the weak factor is 1.8, 30 x 0.8 / 1.2
    ],
)
def test_the_slower_the_rank_the_fewer_steps_of_evidence(
    ratios: list[float], factor: float, steps: int
) -> None:
    assert ss.needed_steps(ratios, factor) == steps


@pytest.mark.parametrize(
    ("before", "after", "found"),
    [
        ((10, 1.0, 0.5), (20, 3.0, 0.5), ss.Interval(9.0, 10, 0.2, 0.0)),
        ((10, 1.0, 0.5), (14, 1.8, 1.3), ss.Interval(9.0, 4, 0.2, 0.2)),
        (None, (20, 3.0, 0.5), None),  # the first report: a baseline
        ((10, 1.0, 0.5), (10, 1.0, 0.5), None),  # no step timed since (a section, a hang)
        ((90, 9.0, 4.5), (5, 0.5, 0.2), None),  # a new process counts from 0 again
    ],
)
def test_an_interval_is_the_means_per_step_between_two_reports(
    before: tuple[int, float, float] | None,
    after: tuple[int, float, float],
    found: ss.Interval | None,
) -> None:
    got = ss.interval(before, after, 9.0)
    assert got == (pytest.approx(found) if found else None)


def test_each_check_takes_the_newest_intervals_back_to_three_steps() -> None:
    ivs = collections.deque(
        [
            ss.Interval(1.0, 10, 0.1, 0.0),
            ss.Interval(3.0, 2, 0.4, 0.1),
            ss.Interval(5.0, 4, 0.4, 0.1),
        ]
    )
    assert ss.recent(ivs, 5.0) == ss.Window(0.4, 0.1, 4, 5.0, 5.0)  # the newest alone
    ivs.append(ss.Interval(7.0, 1, 0.1, 0.0))
    window = ss.recent(ivs, 7.0)  # the newest has 1 step: with the one before, 5
    assert window == ss.Window(pytest.approx(1.7 / 5), pytest.approx(0.08), 5, 5.0, 7.0)
    assert ss.recent(collections.deque([ss.Interval(1.0, 2, 0.1, 0.0)]), 1.0) is None  # 2 steps
    assert ss.recent(ivs, 7.0 + 60) is None  # all older than the sample window


@pytest.mark.parametrize(
    ("pattern", "goes_on"),
    [
        ("S", True),
        ("SM", True),  # one window that misses it: the next decides
        ("SMS", True),
        ("SMM", False),  # two in a row end the episode
        ("SMSMSMSM", True),  # a throttled rank's uneven means: every other window
        ("SSSSSSSMM", False),
    ],
)
def test_an_episode_survives_a_window_that_misses_it_but_not_two(
    pattern: str, goes_on: bool
) -> None:
    episode, alive = ss.Episode(0.0), True
    for i, c in enumerate(pattern):
        window = ss.Window(0.2, 0.0, 5, float(i), float(i))
        alive = episode.count(window, Slow(2.0, 0.2, 0.1, 0.1) if c == "S" else None)
    assert alive is goes_on
    assert episode.steps == 5 * pattern.count("S")


def test_windows_that_share_a_report_count_once() -> None:
    episode = ss.Episode(0.0)
    found = Slow(3.0, 0.3, 0.1, 0.2)
    assert episode.count(ss.Window(0.3, 0.0, 3, 1.0, 2.0), found)
    assert episode.count(ss.Window(0.3, 0.0, 4, 2.0, 3.0), found)  # shares the report at 2.0
    assert (episode.steps, episode.windows) == (3, 1)
    assert episode.count(ss.Window(0.3, 0.0, 4, 3.0, 3.0), found)
    assert (episode.steps, episode.windows) == (7, 2)


def _beat(w: ss.StepSlowness, at: float, steps: int, per_step: dict[int, tuple[float, float]]):
    for rank, (compute, wait) in per_step.items():
        n, c, wt = w._totals.get(rank, (0, 0.0, 0.0))
        w.report(rank, at, totals=(n + steps, c + compute * steps, wt + wait * steps), step=None)


def test_a_rank_at_half_speed_is_proven_by_two_reports_of_its_steps() -> None:
    w = ss.StepSlowness()
    healthy = {0: (0.1, 0.1), 1: (0.1, 0.1), 2: (0.1, 0.0)}
    slow = {0: (0.1, 0.1), 1: (0.1, 0.1), 2: (0.2, 0.0)}  # rank 2 computes twice as long
    _beat(w, 0.0, 1, healthy)  # the baselines
    for at in (2.0, 4.0):
        _beat(w, at, 16, healthy)
        assert w.check(at, 2.0)[2] == []
    _beat(w, 6.0, 8, slow)
    timings, found, proven = w.check(6.0, 2.0)
    assert found[2].ratio == 2.0 and proven == [] and w.episodes[2].steps == 8
    assert timings[2] == pytest.approx((0.2, 0.0))
    w.check(7.0, 2.0)  # no new report: nothing counted twice
    assert w.episodes[2].steps == 8
    _beat(w, 8.0, 8, slow)
    assert w.check(8.0, 2.0)[2] == [2]  # 16 steps >= 12 over two reports


def test_one_long_step_on_every_rank_or_peers_that_do_not_wait_prove_nothing() -> None:
    w = ss.StepSlowness()
    _beat(w, 0.0, 1, {0: (0.1, 0.0), 1: (0.1, 0.0), 2: (0.1, 0.0)})
    # an evaluation not marked as one, seen by rank 2's report first: its peers did not wait
    _beat(w, 2.0, 10, {0: (0.1, 0.0), 1: (0.1, 0.0)})
    _beat(w, 2.0, 1, {2: (90.0, 0.0)})
    assert w.check(2.0, 2.0)[1] == {}
    # a rank 3x slower whose peers never wait for it (no lockstep): not holding anyone back
    for at in (4.0, 6.0, 8.0):
        _beat(w, at, 10, {0: (0.1, 0.0), 1: (0.1, 0.0), 2: (0.3, 0.0)})
        assert w.check(at, 2.0)[2] == []


def test_one_rank_busy_for_one_long_step_while_its_peer_waits_proves_nothing() -> None:
    """tests/runtime/test_hang.py's unmarked evaluation on rank 0 alone (rank 1 waits for it in
    the all-reduce), on a job of 1 s steps: the step is in one window, whichever check sees it."""
    w = ss.StepSlowness()
    _beat(w, 0.0, 1, {0: (1.0, 0.0), 1: (1.0, 0.0)})
    at, proven = 0.0, []
    for beat in range(12):
        at += 2.0
        if beat == 4:  # the busy step and one more since the last report
            _beat(w, at, 2, {0: (18.0, 0.0), 1: (1.0, 17.0)})
        else:
            _beat(w, at, 2, {0: (1.0, 0.0), 1: (1.0, 0.0)})
        proven += w.check(at, 2.0)[2]
        proven += w.check(at + 1.0, 2.0)[2]
    assert proven == []


def test_an_agent_without_sums_gives_one_step_per_new_step_it_reports() -> None:
    w = ss.StepSlowness()
    w.report(0, 1.0, totals=(0, 0.0, 0.0), step=(0.3, 0.0))
    w.report(0, 2.0, totals=(0, 0.0, 0.0), step=None)  # no new step
    assert list(w.intervals[0]) == [ss.Interval(1.0, 1, 0.3, 0.0)]


#: a node's readings: (median, lowest) of its busy connections, 3 heartbeats
Readings = dict[str, list[tuple[float, float]]]


def _links(readings: Readings, connections: int = 3) -> ls.TcpLinks:
    links = ls.TcpLinks()
    for node, rtts in readings.items():
        for i, (rtt, low) in enumerate(rtts):
            links.sample(node, 2.0 * i, rtt, low, connections)
    return links


@pytest.mark.parametrize(
    ("readings", "slow"),
    [
        # node3's egress at 256 kbit (4 nodes, measured): even its heartbeats queue
        (
            {"n1": [(0.005, 0.002)] * 3, "n2": [(0.004, 0.001)] * 3, "n3": [(0.04, 0.022)] * 3},
            {"n3"},
        ),
        # a soak's readings: n3's median counts its connection to the slow n4, not its lowest
        (
            {
                "n1": [(0.0017, 0.0005)] * 3,
                "n2": [(0.0113, 0.0101)] * 3,
                "n3": [(0.0229, 0.0003)] * 3,
                "n4": [(0.0404, 0.0324)] * 3,
            },
            {"n4"},
        ),
        (
            {
                "n1": [(0.005, 0.002)] * 3,
                "n2": [(0.004, 0.001)] * 3,
                "n3": [(0.04, 0.001)] * 2 + [(0.04, 0.03)],
            },
            set(),
        ),  # 1 in 3
        (
            {"n1": [(0.005, 0.002)] * 3, "n2": [(0.004, 0.001)] * 3, "n3": [(0.04, 0.03)] * 2},
            set(),
        ),  # 2 readings
        (
            {"n1": [(0.001, 0.0005)] * 3, "n2": [(0.001, 0.0004)] * 3, "n3": [(0.004, 0.003)] * 3},
            set(),
        ),  # 6x, 2.5 ms
        ({"n3": [(0.04, 0.03)] * 3}, set()),  # nobody to compare with
    ],
)
def test_a_node_whose_every_connection_queues_is_a_slow_link(
    readings: Readings, slow: set[str]
) -> None:
    assert set(_links(readings).check(6.0, 2.0)[1]) == slow


def test_a_node_with_one_busy_connection_is_no_evidence() -> None:
    """Its lowest would be that one connection: to the slow node, it queues."""
    readings = {"n1": [(0.001, 0.001)] * 3, "n2": [(0.001, 0.001)] * 3, "n3": [(0.04, 0.04)] * 3}
    assert _links(readings, connections=1).check(6.0, 2.0) == ({}, {})


def test_old_readings_are_no_evidence() -> None:
    readings = {"n1": [(0.005, 0.002)] * 3, "n2": [(0.004, 0.001)] * 3, "n3": [(0.04, 0.03)] * 3}
    links = _links(readings)
    medians, found = links.check(4.0, 2.0)
    assert medians["n3"] == (0.04, 0.03) and found == {"n3": Slow(20.0, 0.03, 0.0015, 0.0)}
    assert links.check(4.0 + 2.0 * ls.TCP_WINDOW_BEATS + 1, 2.0) == ({}, {})
