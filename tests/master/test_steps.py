"""The job's step as the master writes it to the log (training_progress)."""

from __future__ import annotations

from typing import Any

import pytest

from dlrover_hpc.master import steps
from dlrover_hpc.master.steps import StepLog
from dlrover_hpc.protocol.messages import RankProgress


class Sink:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def __call__(self, name: str, **fields: Any) -> None:
        self.events.append({"event": str(name), **fields})


def _p(rank: int, step: int, at: float) -> RankProgress:
    return RankProgress(rank=rank, step=step, stalled_s=0.0, at=at)


def test_the_step_is_the_slowest_ranks_once_every_rank_reported() -> None:
    sink = Sink()
    log = StepLog(sink, every_s=5.0)
    log.report(node="n1", round=1, world_size=4, progress=[_p(0, 3, 100.0), _p(1, 3, 100.1)])
    assert sink.events == []  # n2's ranks not heard yet
    log.report(node="n2", round=1, world_size=4, progress=[_p(2, 2, 99.9), _p(3, 3, 100.2)])
    assert sink.events == [{"event": "training_progress", "round": 1, "step": 2, "at": 99.9}]
    assert log.node_steps == {"n1": 3, "n2": 2}


def test_one_event_per_interval_of_training_and_the_final_one() -> None:
    sink = Sink()
    log = StepLog(sink, every_s=5.0)
    for i in range(30):  # a step every 0.5 s, reported every second
        log.report(node="n1", round=1, world_size=1, progress=[_p(0, 2 * i, 100.0 + i)])
    assert [e["step"] for e in sink.events] == [0, 10, 20, 30, 40, 50]
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 61, 130.5)], final=True)
    assert sink.events[-1]["step"] == 61
    assert log.step_rate() == (61 - 50) / (130.5 - 125.0)


def test_a_new_round_starts_over_and_late_reports_are_dropped() -> None:
    sink = Sink()
    log = StepLog(sink, every_s=5.0)
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 40, 100.0)])
    log.report(node="n1", round=2, world_size=1, progress=[_p(0, 30, 103.0)])  # restored at 30
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 45, 101.0)])  # too late
    assert [(e["round"], e["step"]) for e in sink.events] == [(1, 40), (2, 30)]
    # A rank that has not written its record yet (at 0) does not count as reported.
    log.report(node="n1", round=3, world_size=2, progress=[_p(0, 31, 104.0), _p(1, 0, 0.0)])
    assert len(sink.events) == 2


def test_the_rate_is_known_early_in_a_round_from_its_reports() -> None:
    # A stop early in a round (a signal seconds after the workers started) needs the rate
    # before two events are written: the reports give it once they span a second.
    log = StepLog(Sink(), every_s=5.0)
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 0, 100.0)])
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 4, 100.5)])
    assert log.step_rate() == 0.0  # half a second: not yet
    log.report(node="n1", round=1, world_size=1, progress=[_p(0, 20, 102.0)])
    assert log.step_rate() == 10.0


def _lockstep(log: StepLog, seconds: float) -> None:
    """64 nodes of 8 ranks, a step every 0.05 s, each node reporting every step."""
    log.report(node="n0", round=1, world_size=1, progress=[_p(0, 0, 99.0)])  # opens round 1
    for step in range(int(seconds / 0.05)):
        at = 100.0 + 0.05 * step
        for node in range(64):
            ranks = [_p(8 * node + r, step, at) for r in range(8)]
            log.report(node=f"n{node}", round=1, world_size=512, progress=ranks)


def test_the_slowest_rank_is_looked_for_twice_a_second_of_steps_not_at_every_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a pass over the 512 ranks at every report would be 64 a step (12,800 here)
    class CountingRanks(dict):
        looks = 0

        def values(self):  # type: ignore[no-untyped-def]
            CountingRanks.looks += 1
            return super().values()

    sink = Sink()
    log = StepLog(sink, every_s=5.0)
    log.report(node="n0", round=1, world_size=1, progress=[_p(0, 0, 99.0)])
    log._ranks = CountingRanks()
    _lockstep(log, 10.0)
    assert CountingRanks.looks <= 10 / steps.EVAL_EVERY_S + 2
    # the same events as a look at every report, but for up to EVAL_EVERY_S of steps (10)
    monkeypatch.setattr(steps, "EVAL_EVERY_S", 0.0)
    every = Sink()
    _lockstep(StepLog(every, every_s=5.0), 10.0)
    assert len(sink.events) == len(every.events) == 3
    for gated, exact in zip(sink.events, every.events, strict=True):
        assert 0 <= gated["step"] - exact["step"] <= 10
