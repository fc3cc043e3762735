"""checkpoint_saved once per node and step (issue 29): the saver's aggregation, its clock ours."""

from __future__ import annotations

import time

import pytest

from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver import save_events as se
from dlrover_hpc.errors import CheckpointError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _saved(expected: int) -> tuple[se.SavedEvents, ListEventSink, Clock]:
    sink, clock = ListEventSink(), Clock()
    return se.SavedEvents(sink.emit, expected=lambda: expected, clock=clock), sink, clock


def test_one_line_per_step_once_every_connected_rank_saved() -> None:
    saved, sink, _ = _saved(expected=4)
    for rank, blocking in ((0, 0.010), (1, 0.012), (2, 0.011)):
        saved.report(rank=rank, step=5, storage="memory", blocking_s=blocking, total_s=0.02)
    assert sink.named("checkpoint_saved") == []  # rank 3 not yet
    saved.report(rank=3, step=5, storage="memory", blocking_s=0.013, total_s=0.03)
    [line] = sink.named("checkpoint_saved")
    assert line["step"] == 5 and line["storage"] == "memory" and line["ranks"] == [0, 1, 2, 3]
    # the job waits for its slowest rank: the report's blocking time stays exact
    assert line["blocking_s"] == 0.013 and line["total_s"] == 0.03
    assert line["blocking_median_s"] == pytest.approx(0.0115)
    assert "rank" not in line


def test_a_rank_that_stands_out_gets_its_own_line_too() -> None:
    saved, sink, _ = _saved(expected=3)
    for rank, blocking in ((0, 0.010), (1, 0.011), (2, 0.300)):
        saved.report(rank=rank, step=10, storage="disk", blocking_s=blocking, total_s=blocking)
    node_line, own = sink.named("checkpoint_saved")
    assert node_line["ranks"] == [0, 1, 2] and node_line["blocking_s"] == 0.3
    assert own == {**own, "rank": 2, "step": 10, "blocking_s": 0.3, "outlier": True}


def test_a_step_some_rank_never_saved_is_written_after_the_flush_time() -> None:
    saved, sink, clock = _saved(expected=2)
    saved.report(rank=0, step=15, storage="memory", blocking_s=0.01, total_s=0.01)
    first_at = sink.events  # nothing yet
    assert first_at == []
    clock.now += se.FLUSH_S - 0.1
    saved.flush()
    assert sink.named("checkpoint_saved") == []
    clock.now += 0.2
    saved.flush()
    [line] = sink.named("checkpoint_saved")
    assert line["ranks"] == [0] and line["step"] == 15
    # ... or at the next step's report, or when the saver closes
    saved.report(rank=1, step=20, storage="memory", blocking_s=0.01, total_s=0.01)
    clock.now += se.FLUSH_S
    saved.report(rank=0, step=25, storage="memory", blocking_s=0.01, total_s=0.01)
    assert [e["step"] for e in sink.named("checkpoint_saved")] == [15, 20]
    saved.flush(everything=True)
    assert [e["step"] for e in sink.named("checkpoint_saved")] == [15, 20, 25]


def test_the_line_carries_the_time_of_the_first_report() -> None:
    saved, sink, clock = _saved(expected=2)
    before = time.time()
    saved.report(rank=0, step=5, storage="memory", blocking_s=0.01, total_s=0.01)
    time.sleep(0.05)
    between = time.time()
    clock.now += 1.0
    saved.report(rank=1, step=5, storage="memory", blocking_s=0.01, total_s=0.01)
    [line] = sink.named("checkpoint_saved")
    assert before <= line["time"] < between  # when the save happened, not when it was written


@pytest.mark.parametrize(
    "fields",
    [
        {"rank": -1},
        {"step": -5},
        {"storage": "tape"},
        {"blocking_s": float("nan")},
        {"total_s": float("inf")},
        {"blocking_s": -1.0},
        {"rank": "zero"},
        {"rank": float("inf")},
        {"local_world": 1 << 40},
    ],
)
def test_a_report_that_makes_no_sense_is_refused(fields: dict) -> None:
    saved, sink, _ = _saved(expected=1)
    good = {"rank": 0, "step": 5, "storage": "memory", "blocking_s": 0.01, "total_s": 0.01}
    with pytest.raises(CheckpointError):
        saved.report(**{**good, **fields})
    assert sink.events == []
