"""Pure analysis of the pairwise network check: plans, verdicts, and simulated whole checks."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrover_hpc.netcheck.analysis import (
    CheckVerdict,
    Group,
    GroupResult,
    NetcheckError,
    RoundResult,
    analyze,
    plan_next_round,
    plan_round1,
    plan_round2,
    run_check,
)

pytestmark = pytest.mark.timeout(60)


def names(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def simulated_round(
    faulty: Collection[str] = (), base_s: Mapping[str, float] | None = None
) -> Callable[[int, list[Group]], RoundResult]:
    """A group fails iff it holds a faulty node; members of a passing group all take as long as
    its slowest member (a collective waits for everyone)."""
    bad = set(faulty)
    base = dict(base_s or {})

    def run_round(index: int, groups: list[Group]) -> RoundResult:
        results = []
        for group in groups:
            ok = not bad.intersection(group)
            slowest = max(base.get(n, 1.0) for n in group)
            elapsed = {n: slowest for n in group} if ok else {}
            results.append(GroupResult(nodes=group, ok=ok, elapsed_s=elapsed))
        return RoundResult(round_index=index, groups=tuple(results))

    return run_round


def rounds_of(*spec: list[tuple[tuple[str, ...], bool]]) -> list[RoundResult]:
    return [
        RoundResult(
            round_index=i + 1,
            groups=tuple(GroupResult(nodes=g, ok=ok) for g, ok in groups),
        )
        for i, groups in enumerate(spec)
    ]


# --- planning ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "expected"),
    [
        (0, []),
        (1, []),
        (2, [("n0", "n1")]),
        (3, [("n0", "n1", "n2")]),
        (4, [("n0", "n1"), ("n2", "n3")]),
        (5, [("n0", "n1"), ("n2", "n3", "n4")]),
        (6, [("n0", "n1"), ("n2", "n3"), ("n4", "n5")]),
    ],
)
def test_round1_pairs_neighbours_in_rank_order(count: int, expected: list[Group]) -> None:
    assert plan_round1(names(count)) == expected


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        (["a", "b", "a"], "node 'a' is listed twice"),
        ("ab", "got the string 'ab'"),
    ],
)
def test_round1_rejects_bad_node_lists(nodes: list[str], message: str) -> None:
    with pytest.raises(NetcheckError, match=message):
        plan_round1(nodes)


@pytest.mark.parametrize(
    ("count", "failed"),
    [(6, {"n2"}), (6, {"n0", "n5"}), (8, {"n1", "n2"}), (7, {"n6"}), (9, {"n0", "n3"})],
)
def test_round2_gives_each_suspect_a_healthy_partner(count: int, failed: set[str]) -> None:
    nodes = names(count)
    suspects = {n for g in plan_round1(nodes) if failed & set(g) for n in g}
    healthy = set(nodes) - suspects
    groups = plan_round2(nodes, failed)
    placed = [n for g in groups for n in g]
    assert len(placed) == len(set(placed)), "a node runs one probe per round"
    for group in groups:
        if suspects & set(group):
            assert len(suspects & set(group)) == 1, group
            assert healthy & set(group), group
    # Every suspect is placed when there are enough healthy partners.
    if len(healthy) >= len(suspects):
        assert suspects <= set(placed)


def test_round2_rejects_unknown_failed_nodes() -> None:
    with pytest.raises(NetcheckError, match=r"failed nodes \['x'\] are not among"):
        plan_round2(names(4), {"x"})


def test_round2_without_healthy_nodes_pairs_strangers() -> None:
    # Both round-1 pairs failed: re-pair across the old pairs.
    groups = plan_round2(names(4), {"n0", "n2"})
    assert sorted(map(sorted, groups)) == [["n0", "n3"], ["n1", "n2"]]


def test_no_plan_when_nothing_is_left_to_learn() -> None:
    rounds = rounds_of([(("a", "b"), True), (("c", "d"), True)])
    assert plan_next_round(rounds) == []


# --- verdicts -----------------------------------------------------------------------------------


def test_all_pass_needs_one_round() -> None:
    verdict = analyze(rounds_of([(("a", "b"), True), (("c", "d"), True)]))
    assert verdict == CheckVerdict(
        faulty=frozenset(),
        stragglers=frozenset(),
        healthy=frozenset("abcd"),
        unresolved=frozenset(),
        needs_another_round=False,
        rounds_used=1,
        timings_s={},
        median_s=None,
    )


@pytest.mark.parametrize(
    ("spec", "faulty", "unresolved", "more"),
    [
        # Failing next to a known-healthy partner convicts.
        (
            [
                [(("a", "b"), False), (("c", "d"), True)],
                [(("a", "c"), False), (("b", "d"), True)],
            ],
            {"a"},
            set(),
            False,
        ),
        # Elimination: b passed, so a is the culprit of round 1's failed pair.
        (
            [
                [(("a", "b"), False), (("c", "d"), True)],
                [(("b", "c"), True)],
            ],
            {"a"},
            set(),
            False,
        ),
        # b failed in every group but is never blamed: its partners were faulty each time.
        (
            [
                [(("a", "b"), False), (("c", "d"), True), (("e", "f"), False)],
                [(("a", "c"), False), (("b", "e"), False), (("d", "f"), True)],
            ],
            {"a", "e"},
            {"b"},
            True,
        ),
        # After round 1 alone nobody can be blamed.
        ([[(("a", "b"), False), (("c", "d"), True)]], set(), {"a", "b"}, True),
    ],
)
def test_verdict_table(
    spec: list[list[tuple[tuple[str, ...], bool]]],
    faulty: set[str],
    unresolved: set[str],
    more: bool,
) -> None:
    verdict = analyze(rounds_of(*spec))
    assert verdict.faulty == faulty
    assert verdict.unresolved == unresolved
    assert verdict.needs_another_round is more


def test_failure_of_two_healthy_nodes_is_reported_but_blames_none() -> None:
    verdict = analyze(
        rounds_of(
            [(("a", "b"), False), (("c", "d"), True)],
            [(("a", "c"), True), (("b", "d"), True)],
        )
    )
    assert verdict.faulty == frozenset()
    assert verdict.unexplained_failures == (("a", "b"),)


def test_max_rounds_stops_the_check_and_leaves_nodes_unresolved() -> None:
    rounds = rounds_of([(("a", "b"), False), (("c", "d"), True)])
    verdict = analyze(rounds, max_rounds=1)
    assert not verdict.needs_another_round
    assert verdict.unresolved == {"a", "b"} and not verdict.faulty


def test_straggler_is_confirmed_with_a_new_partner() -> None:
    nodes = names(8)
    base = {"n3": 3.0}
    run_round = simulated_round(base_s=base)
    round1 = run_round(1, plan_round1(nodes))
    verdict = analyze([round1])
    # Its partner waited for it in the collective and looks slow too, for now.
    assert verdict.stragglers == {"n2", "n3"}
    assert verdict.needs_another_round
    round2 = run_round(2, plan_next_round([round1]))
    verdict = analyze([round1, round2])
    assert verdict.stragglers == {"n3"}
    assert not verdict.needs_another_round
    assert verdict.median_s == 1.0 and verdict.timings_s["n3"] == 3.0


def test_median_of_an_even_count_is_the_mean_of_the_middle_two() -> None:
    groups = (
        GroupResult(nodes=("a", "b"), ok=True, elapsed_s={"a": 1.0, "b": 1.0}),
        GroupResult(nodes=("c", "d"), ok=True, elapsed_s={"c": 2.0, "d": 10.0}),
    )
    verdict = analyze([RoundResult(round_index=1, groups=groups)], max_rounds=1)
    assert verdict.median_s == 1.5
    assert verdict.stragglers == {"d"}


def test_a_straggler_must_also_be_25_ms_slower_than_the_median() -> None:
    """CI: a healthy node timed at 30 ms against a 13 ms median, in both rounds, on a host
    busy with other jobs; a slow link here takes 0.3-0.7 s against ~20 ms."""

    def checked(times: dict[str, float]) -> frozenset[str]:
        pairs = [tuple(list(times)[i : i + 2]) for i in range(0, len(times), 2)]
        groups = tuple(
            GroupResult(nodes=p, ok=True, elapsed_s={n: times[n] for n in p}) for p in pairs
        )
        return analyze([RoundResult(round_index=1, groups=groups)], max_rounds=1).stragglers

    busy = {"node1": 0.013, "node2": 0.013, "node3": 0.030, "node4": 0.013}
    assert checked(busy) == frozenset()  # 2.3x, 17 ms more: a busy host
    assert checked({**busy, "node3": 0.039}) == {"node3"}  # 3x, 26 ms more
    assert checked({**busy, "node3": 0.711, "node1": 0.021}) == {"node3"}  # a slow link
    assert checked({"a": 1.0, "b": 1.0, "c": 1.9, "d": 1.0}) == frozenset()  # under 2x


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: GroupResult(nodes=("a",), ok=True), r"has 1 node\(s\)"),
        (lambda: GroupResult(nodes=("a", "a"), ok=True), "names a node twice"),
        (
            lambda: GroupResult(nodes=("a", "b"), ok=True, elapsed_s={"c": 1.0}),
            "reports a time for 'c', which is not a member",
        ),
        (
            lambda: GroupResult(nodes=("a", "b"), ok=True, elapsed_s={"a": -1.0}),
            r"elapsed_s\['a'\] = -1.0; expected a finite number",
        ),
        (
            lambda: RoundResult(
                round_index=2,
                groups=(
                    GroupResult(nodes=("a", "b"), ok=True),
                    GroupResult(nodes=("b", "c"), ok=True),
                ),
            ),
            "round 2: node 'b' is in group",
        ),
        (lambda: analyze([], max_rounds=0), "max_rounds=0"),
        (lambda: analyze([], straggler_factor=1.0), "straggler_factor=1.0"),
    ],
)
def test_malformed_results_are_rejected(build: Callable[[], object], message: str) -> None:
    with pytest.raises(NetcheckError, match=message):
        build()


def test_run_check_rejects_results_for_other_groups() -> None:
    def wrong(index: int, groups: list[Group]) -> RoundResult:
        return RoundResult(round_index=index, groups=(GroupResult(nodes=("n0", "n2"), ok=True),))

    with pytest.raises(NetcheckError, match="run_round reported groups"):
        run_check(names(4), run_round=wrong)


# --- whole checks, simulated ------------------------------------------------------------------


@st.composite
def cluster_with_faults(draw: st.DrawFn, *, max_share: float = 0.25) -> tuple[int, set[str]]:
    count = draw(st.integers(min_value=2, max_value=300))
    faults = draw(st.integers(min_value=0, max_value=int(count * max_share)))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return count, set(random.Random(seed).sample(names(count), faults))


@settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(cluster_with_faults())
def test_up_to_a_quarter_faulty_is_found_exactly_within_three_rounds(
    case: tuple[int, set[str]],
) -> None:
    count, faulty = case
    verdict, rounds = run_check(names(count), run_round=simulated_round(faulty))
    assert verdict.faulty == faulty
    assert not verdict.unresolved
    assert len(rounds) <= 3
    assert not verdict.needs_another_round


@settings(max_examples=200, deadline=None, database=None)
@given(st.integers(min_value=4, max_value=300), st.data())
def test_one_faulty_node_is_found_in_two_rounds(count: int, data: st.DataObject) -> None:
    faulty = data.draw(st.sampled_from(names(count)))
    verdict, rounds = run_check(names(count), run_round=simulated_round({faulty}))
    assert verdict.faulty == {faulty}
    # Five nodes are the exception: a failed triple next to only two healthy nodes.
    assert len(rounds) <= (3 if count == 5 else 2)


@settings(max_examples=200, deadline=None, database=None)
@given(cluster_with_faults(max_share=1.0), st.integers(min_value=1, max_value=6))
def test_a_healthy_node_is_never_blamed(case: tuple[int, set[str]], max_rounds: int) -> None:
    count, faulty = case
    verdict, rounds = run_check(
        names(count), run_round=simulated_round(faulty), max_rounds=max_rounds
    )
    assert verdict.faulty <= faulty
    assert not verdict.healthy & faulty
    assert verdict.faulty | verdict.healthy | verdict.unresolved == set(names(count))
    assert len(rounds) <= max_rounds


@settings(max_examples=150, deadline=None, database=None)
@given(st.integers(min_value=10, max_value=300), st.data())
def test_stragglers_are_told_apart_from_their_partners(count: int, data: st.DataObject) -> None:
    rng = random.Random(data.draw(st.integers(min_value=0, max_value=2**32 - 1)))
    slow = set(rng.sample(names(count), data.draw(st.integers(0, count // 10))))
    base = {
        n: (rng.uniform(3.0, 4.0) if n in slow else rng.uniform(0.9, 1.1)) for n in names(count)
    }
    verdict, rounds = run_check(names(count), run_round=simulated_round(base_s=base))
    assert verdict.stragglers == slow
    assert len(rounds) <= 2
