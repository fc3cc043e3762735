"""The crash-loop guard's rule, called directly: each row a sequence of round ends, and what
the guard does after each one.  No server, no clock."""

from __future__ import annotations

import pytest

from dlrover_hpc.master import crash_loop as cl
from dlrover_hpc.master import decisions as d
from dlrover_hpc.protocol import messages as m

SEGV = "the worker crashed with SIGSEGV; no hardware error was logged [signal SIGSEGV (11)]"
XID = "GPU Xid error [NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.]"
NODES = ("n1", "n2", "n3", "n4", "n5")


def fail(
    round: int, node: str = "n1", *, rank: int = 0, kind: str = "software", error: str = SEGV
) -> cl.Failure:
    return cl.Failure(round=round, node=node, rank=rank, classification=kind, error=error)


def end(
    round: int,
    failure: cl.Failure | None,
    *,
    step: int = 4,
    saved: int = -1,
    committed: int = -1,
) -> cl.RoundEnd:
    return cl.RoundEnd(round=round, failure=failure, step=step, saved=saved, committed=committed)


def segv(round: int, **kw: int) -> cl.RoundEnd:
    """A script that SIGSEGVs on rank 0 (node n1) at step 5 of every attempt, from step 0."""
    return end(round, fail(round), **kw)


def hw(round: int) -> cl.RoundEnd:
    """A fault the agent classifies as hardware, on the node holding rank 0 in that round
    (the hardware rule excludes each one; a spare takes its place and fails the same way)."""
    return end(round, fail(round, NODES[round - 1], kind="hardware", error=XID))


def lost(round: int) -> cl.RoundEnd:
    """Node n3 (ranks 4-5) lost at the same step in every round (relaunched each time)."""
    return end(round, fail(round, "n3", rank=4, kind=cl.NODE_LOST, error="connection closed"))


def stopped(*streak: cl.Failure) -> list[d.Action]:
    return cl.stop(streak)


def run(
    ends: list[cl.RoundEnd], *, rounds: int = 3, usable: tuple[str, ...] = NODES, min_nodes: int = 2
) -> list[list[d.Action]]:
    guard, out = cl.Guard(rounds=rounds), []
    for e in ends:
        guard, actions = cl.judge(guard, e, usable=usable, min_nodes=min_nodes)
        out.append(actions)
        if any(isinstance(a, d.Finish) for a in actions):
            break
    return out


def excluded(node: str, a: int, b: int, failure: cl.Failure, k: int = 3) -> d.Exclude:
    return d.Exclude(
        node,
        f"crash loop: it failed first in rounds {a} and {b} of the last {k} ({failure.describe()})",
    )


@pytest.mark.parametrize(
    "ends,kw,expected",
    [
        # The SIGSEGV at step 5 of every attempt: round 1 reached step 4 from nothing (progress);
        # rounds 2, 3 and 4 reach no further, so the 4th round stops the job.  Rank 0's node n1
        # caused rounds 1 and 2 of the window: excluded, the others being enough (once).
        pytest.param(
            [segv(1), segv(2), segv(3), segv(4)],
            {},
            [[], [excluded("n1", 1, 2, fail(2))], [], stopped(fail(2), fail(3), fail(4))],
            id="segv-same-step-every-attempt",
        ),
        # ... with only MIN nodes, n1 cannot go: it stays, and the loop still ends.
        pytest.param(
            [segv(1), segv(2), segv(3), segv(4)],
            {"usable": ("n1", "n2"), "min_nodes": 2},
            [[], [], [], stopped(fail(2), fail(3), fail(4))],
            id="segv-node-kept-at-min",
        ),
        # A fault classified as hardware, on a new node each round (each excluded, a spare in
        # its place): no restart is charged, so today it cycles through every node.
        pytest.param(
            [hw(1), hw(2), hw(3), hw(4), hw(5)],
            {},
            [
                [],
                [],
                [],
                stopped(
                    fail(2, "n2", kind="hardware", error=XID),
                    fail(3, "n3", kind="hardware", error=XID),
                    fail(4, "n4", kind="hardware", error=XID),
                ),
            ],
            id="hardware-loop",
        ),
        # A node lost at the same point in every round (relaunched each time, no restart
        # charged): n3 is excluded once it caused two rounds, or the loop ends.
        pytest.param(
            [lost(1), lost(2), lost(3), lost(4)],
            {},
            [
                [],
                [
                    excluded(
                        "n3",
                        1,
                        2,
                        fail(2, "n3", rank=4, kind=cl.NODE_LOST, error="connection closed"),
                    )
                ],
                [],
                stopped(
                    *(
                        fail(r, "n3", rank=4, kind=cl.NODE_LOST, error="connection closed")
                        for r in (2, 3, 4)
                    )
                ),
            ],
            id="node-lost-at-the-same-point",
        ),
        # A crash before any step (step 0: where a fresh job's ranks start): round 1 already
        # made no progress.
        pytest.param(
            [segv(1, step=0), segv(2, step=0), segv(3, step=0)],
            {"usable": ("n1", "n2")},
            [[], [], stopped(fail(1), fail(2), fail(3))],
            id="crash-before-the-first-step",
        ),
        # ... once the job's progress has been seen, a round that reported nothing (a node lost
        # before its ranks' first report) made none either.
        pytest.param(
            [
                segv(1, step=0),
                end(
                    2, fail(2, "n3", rank=4, kind=cl.NODE_LOST, error="connection closed"), step=-1
                ),
                segv(3, step=-1),
            ],
            {"usable": ("n1", "n2")},
            [
                [],
                [],
                stopped(
                    fail(1),
                    fail(2, "n3", rank=4, kind=cl.NODE_LOST, error="connection closed"),
                    fail(3),
                ),
            ],
            id="silent-rounds-after-progress-was-seen",
        ),
        # No round ever reported a step, a save or a commit (the worker hooks off, no progress
        # calls): the master cannot see progress, so it never calls it a loop.
        pytest.param(
            [segv(r, step=-1) for r in range(1, 7)],
            {"usable": ("n1", "n2")},
            [[]] * 6,
            id="progress-never-seen",
        ),
        # Each round gets one step further: progress every time, never stopped.
        pytest.param(
            [segv(r, step=4 + r) for r in range(1, 7)],
            {"usable": ("n1", "n2")},
            [[]] * 6,
            id="a-step-further-each-round",
        ),
        # Same step, but each round commits a newer checkpoint: progress.
        pytest.param(
            [segv(r, committed=10 * r) for r in range(1, 7)],
            {"usable": ("n1", "n2")},
            [[]] * 6,
            id="a-newer-commit-each-round",
        ),
        # ... or every rank holds a newer step in memory: progress too.
        pytest.param(
            [segv(r, saved=10 * r) for r in range(1, 7)],
            {"usable": ("n1", "n2")},
            [[]] * 6,
            id="a-newer-step-in-memory-each-round",
        ),
        # A commit of a step already held in memory by every rank is no news: rounds 2-4
        # (whose persist-on-failure commits step 10 again) stop the job.
        pytest.param(
            [segv(1, saved=10), segv(2, committed=10), segv(3, committed=10), segv(4)],
            {"usable": ("n1", "n2")},
            [[], [], [], stopped(fail(2), fail(3), fail(4))],
            id="the-same-checkpoint-again",
        ),
        # Progress in round 3 breaks the run: it takes 3 more failed rounds after it.
        pytest.param(
            [segv(1), segv(2), segv(3, step=9), segv(4), segv(5), segv(6)],
            {"usable": ("n1", "n2")},
            [[], [], [], [], [], stopped(fail(4), fail(5), fail(6))],
            id="progress-breaks-the-run",
        ),
        # Rounds that ended for no failure (a scale-up, a straggler swap) and made no progress
        # neither count nor break the run.
        pytest.param(
            [segv(1), segv(2), end(3, None), segv(4), end(5, None), segv(6)],
            {"usable": ("n1", "n2")},
            [[], [], [], [], [], stopped(fail(2), fail(4), fail(6))],
            id="rounds-without-failure-are-neutral",
        ),
        # K = 1: the first failed round without progress stops the job.
        pytest.param(
            [segv(1), segv(2)],
            {"rounds": 1},
            [[], stopped(fail(2))],
            id="one-round",
        ),
        # Off: never stopped, nothing excluded.
        pytest.param(
            [segv(r) for r in range(1, 9)],
            {"rounds": 0},
            [[]] * 8,
            id="off",
        ),
    ],
)
def test_judge(ends: list[cl.RoundEnd], kw: dict, expected: list[list[d.Action]]) -> None:
    assert run(ends, **kw) == expected


def test_the_stop_names_the_failure_most_rounds_share() -> None:
    other = fail(3, "n2", rank=2, error="the program raised RuntimeError: boom")
    [loop, finish] = cl.stop([fail(2), other, fail(4)])
    assert loop == d.CrashLoop(
        rounds=3,
        failure=fail(4).fields(),
        failures=[fail(2).fields(), other.fields(), fail(4).fields()],
    )
    assert finish == d.Finish(
        cl.EXIT_CODE,
        f"crash loop: 3 rounds in a row (rounds 2-4) failed without progress; 2 of 3 times "
        f"first rank 0 on n1 (software): {SEGV}",
    )
    [_, same] = cl.stop([fail(2), fail(3), fail(4)])
    assert isinstance(same, d.Finish) and "; each time first rank 0 on n1 (software)" in (
        same.reason
    )


def test_a_node_already_out_of_the_job_is_not_excluded_again() -> None:
    guard = cl.Guard(rounds=3)
    for r in (1, 2):  # a hang rule, say, excluded n1 at its second hang
        guard, actions = cl.judge(
            guard, segv(r, step=r), usable=NODES, min_nodes=2, excluded={"n1"}
        )
        assert actions == []


def test_a_node_is_excluded_once() -> None:
    guard = cl.Guard(rounds=5)
    said = []
    for r in range(1, 5):
        guard, actions = cl.judge(guard, segv(r, step=r), usable=NODES, min_nodes=2)
        said += actions
    assert said == [excluded("n1", 1, 2, fail(2), k=5)]  # progress each round: not a loop


@pytest.mark.parametrize(
    "reason,line",
    [
        (SEGV, SEGV),
        ("\n  the program raised ValueError: x\nTraceback ...", "the program raised ValueError: x"),
        ("x" * 400, "x" * 297 + "..."),
        ("", ""),
    ],
)
def test_error_line(reason: str, line: str) -> None:
    assert cl.error_line(reason) == line


def _p(rank: int, step: int, saved: int = -1, at: float = 1.0) -> m.RankProgress:
    return m.RankProgress(rank=rank, step=step, stalled_s=0.0, saved_step=saved, at=at)


@pytest.mark.parametrize(
    "reports,failures,world,expected",
    [
        # Each rank's furthest step counts, an older (stale) report does not lower it.
        (
            [(1, [_p(0, 3), _p(1, 4)]), (1, [_p(0, 2)])],
            [],
            2,
            end(1, None, step=4, saved=-1, committed=7),
        ),
        # Every rank holds a step in memory: the oldest of them; one rank silent: unknown.
        ([(1, [_p(0, 5, 5), _p(1, 5, 10)])], [], 2, end(1, None, step=5, saved=5, committed=7)),
        ([(1, [_p(0, 5, 5)])], [], 2, end(1, None, step=5, saved=-1, committed=7)),
        # A rank that has not stepped yet (no step time) reached no step.
        ([(1, [_p(0, 0, at=0.0), _p(1, 0, at=0.0)])], [], 2, end(1, None, step=-1, committed=7)),
        # A report of another round is not this round's.
        ([(2, [_p(0, 50, 50)])], [], 1, end(1, None, step=-1, saved=-1, committed=7)),
        # The cause: the first failure that is not a peer's symptom.
        (
            [],
            [fail(1, "n2", rank=2, kind="peer"), fail(1), fail(1, "n3", rank=4)],
            2,
            end(1, fail(1), step=-1, committed=7),
        ),
        # ... else the first peer report.
        (
            [],
            [fail(1, "n2", rank=2, kind="peer"), fail(1, kind="peer")],
            2,
            end(1, fail(1, "n2", rank=2, kind="peer"), step=-1, committed=7),
        ),
        # A failure of another round is not this round's.
        ([], [fail(0)], 2, end(1, None, step=-1, committed=7)),
    ],
)
def test_tally(
    reports: list[tuple[int, list[m.RankProgress]]],
    failures: list[cl.Failure],
    world: int,
    expected: cl.RoundEnd,
) -> None:
    tally = cl.RoundTally()
    tally.begin(1)
    for round, ranks in reports:
        tally.progress(round, ranks)
    for f in failures:
        tally.failed(f)
    assert tally.end(world_size=world, committed=7) == expected


def test_watch_judges_each_round_once_and_the_job_failing_now_leaves_the_guard() -> None:
    watch = cl.LoopWatch(2)
    facts = {"world_size": 2, "committed": -1, "usable": {"n1", "n2"}, "min_nodes": 2}
    assert watch.round_ended(**facts) == []  # no round yet
    for r in (1, 2):
        watch.tally.begin(r)
        watch.tally.progress(r, [_p(0, 4), _p(1, 4)])
        watch.tally.failed(fail(r))
        assert watch.round_ended(**facts) == []  # round 1: progress; round 2: the first
        assert watch.round_ended(**facts) == []  # judged once
    watch.tally.begin(3)
    watch.tally.progress(3, [_p(0, 4), _p(1, 4)])
    watch.tally.failed(fail(3))
    assert watch.failing_now(**facts) == cl.stop([fail(2), fail(3)])
    assert watch.guard.streak == (fail(2),)  # unchanged
    assert watch.round_ended(**facts) == cl.stop([fail(2), fail(3)])
    off = cl.LoopWatch(0)
    off.tally.begin(1)
    off.tally.failed(fail(1))
    assert off.failing_now(**facts) == [] and off.round_ended(**facts) == []


def test_negative_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="0 \\(off\\) or more"):
        cl.Guard(rounds=-1)


def test_the_exit_code_is_its_own_and_the_template_never_trains_after_it() -> None:
    """Not 0/1/2 (ok, failed, bad input) nor a signal's 128+N; the job template's requeued
    run stops at it (tests/runtime/test_crash_loop.py requeues a crash-looped job)."""
    from dlrover_hpc.cli import template

    assert cl.EXIT_CODE not in (0, 1, 2) and cl.EXIT_CODE < 128
    script = (template.TEMPLATES / "train.sbatch").read_text()
    assert f'if [ "$verdict" = {cl.EXIT_CODE} ]; then' in script
    assert f"        exit {cl.EXIT_CODE}\n" in script


@pytest.mark.parametrize("kinds", [("software", "peer"), ("peer", "software"), ("peer", "peer")])
def test_a_round_a_node_only_lost_a_peer_in_does_not_count_towards_its_exclusion(
    kinds: tuple[str, str],
) -> None:
    """Rank 3 on n1 is killed (software) and the job trains on; then another node dies and
    n1's worker is the first to report that it lost its peer (a round's cause when no own
    failure came first).  n1 failed on its own once: it stays (the in-process
    runtime test saw such a node excluded: the job went on without it)."""
    guard = cl.Guard(rounds=3)
    said = []
    for r, kind in enumerate(kinds, start=1):
        guard, actions = cl.judge(
            guard, end(r, fail(r, kind=kind), step=10 * r), usable=NODES, min_nodes=2
        )
        said += actions
    assert said == []


KILLED = (
    "the worker was killed with SIGKILL without OOM evidence (by the agent, Slurm or an operator)"
)


def test_a_worker_killed_from_outside_is_not_charged_to_its_node() -> None:
    """Soak seed 1: a worker of n1 SIGKILLed by an operator, 400 steps later n1's link cut
    (node lost): two causes on n1 in the window, but the kill was no fault of n1's, so n1
    stays.  A second loss of n1 is its own again: excluded then."""
    guard = cl.Guard(rounds=3)
    killed = cl.Failure(round=1, node="n1", rank=0, classification="software", error=KILLED,
                        external=True)  # fmt: skip
    said = []
    for r, failure in enumerate(
        [killed, fail(2, kind=cl.NODE_LOST, error="link timed out")], start=1
    ):
        guard, actions = cl.judge(guard, end(r, failure, step=400 * r), usable=NODES, min_nodes=2)
        said += actions
    assert said == []
    lost = fail(3, kind=cl.NODE_LOST, error="link timed out")
    guard, actions = cl.judge(guard, end(3, lost, step=1200), usable=NODES, min_nodes=2)
    assert actions == [excluded("n1", 2, 3, lost)]


def test_kills_from_outside_without_progress_still_end_the_job_as_a_crash_loop() -> None:
    """A worker killed at the same point each attempt (a watchdog of the site's, say) fails
    the rounds: K of them in a row without progress stop the job; its node is never
    excluded for them."""
    guard, said = cl.Guard(rounds=3), []
    for r in range(1, 5):
        killed = cl.Failure(
            round=r, node="n1", rank=0, classification="software", error=KILLED, external=True
        )
        guard, actions = cl.judge(guard, end(r, killed), usable=NODES, min_nodes=2)
        said.append(actions)
    assert not any(isinstance(a, d.Exclude) for actions in said for a in actions)
    assert any(isinstance(a, d.Finish) for a in said[-1])


def test_the_diagnosis_rule_of_an_outside_kill_is_external() -> None:
    from dlrover_hpc.diagnosis.classify import classify
    from dlrover_hpc.diagnosis.evidence import FailureEvidence

    diagnosis = classify(FailureEvidence(exit_code=-9))
    assert diagnosis.rule in cl.EXTERNAL_RULES
    assert m.WorkerFailed(
        agent_id="a", round=1, local_rank=0, rank=0, exit_code=-9, signal="SIGKILL",
        classification="software", reason="", rule=diagnosis.rule,
    ).rule == "killed"  # fmt: skip
