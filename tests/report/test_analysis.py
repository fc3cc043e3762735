"""Goodput and lost time from an event log (pure): hand-made logs with known answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from dlrover_hpc.errors import ReportError
from dlrover_hpc.report.analysis import Analysis, analyze, read_events
from dlrover_hpc.report.model import Cause, LaneState
from dlrover_hpc.report.table import print_report

T0 = 1_800_000_000.0


def ev(t: float, name: str, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "event": name, **fields}


def progress(round: int, *samples: tuple[float, int]) -> list[dict[str, Any]]:
    return [ev(t, "training_progress", round=round, step=s, at=T0 + t) for t, s in samples]


def failed_and_restored() -> list[dict[str, Any]]:
    """0.2 s steps; a worker fails at step ~40, the round restores step 30 and finishes 60."""
    return [
        ev(0, "job_started", job_id="7", nnodes="2:2"),
        ev(1, "node_joined", node="n1", agent="n1-1"),
        ev(1, "node_joined", node="n2", agent="n2-2"),
        ev(2, "rendezvous_complete", round=1, nodes=["n1", "n2"], restart_count=0),
        *progress(1, (3, 0), (5, 10), (7, 20), (9, 30), (11, 40)),
        ev(11.5, "worker_failed", node="n2", rank=1, signal="SIGKILL", classification="software"),
        ev(11.6, "worker_failed", node="n1", rank=0, classification="peer"),
        ev(13, "rendezvous_complete", round=2, nodes=["n1", "n2"], restart_count=1),
        ev(13, "workers_restarted", round=2, restart_count=1),
        ev(14, "checkpoint_restored", node="n1", rank=0, step=30, source="memory", restore_s=0.5),
        ev(14, "checkpoint_restored", node="n2", rank=1, step=30, source="peer", restore_s=0.25),
        *progress(2, (14, 30), (16, 40), (18, 50), (20, 60)),
        ev(21, "job_finished", exit_code=0, restart_count=1),
    ]


def test_goodput_is_distinct_steps_times_the_median_step_over_the_wall() -> None:
    r = analyze(failed_and_restored())
    assert (r.steps, r.redone_steps, r.ideal_step_s) == (60, 10, pytest.approx(0.2))
    assert r.wall_s == 21.0 and r.goodput == pytest.approx(60 * 0.2 / 21, abs=1e-4)
    lost = {c: v for c, v in r.lost_s.items() if abs(v) > 1e-9}
    assert lost == {
        Cause.START_UP: pytest.approx(3.0),
        Cause.RENDEZVOUS: pytest.approx(2.0),  # the failure's round to the next one's
        Cause.RESTORE: pytest.approx(0.5),
        Cause.RESTARTS: pytest.approx(0.5),
        Cause.REDONE_STEPS: pytest.approx(2.0),  # steps 31-40 again
        Cause.SHUTDOWN: pytest.approx(1.0),
    }
    assert r.useful_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)
    assert (r.rounds, r.restarts, r.membership_changes) == (2, 1, 0)
    assert r.failures == {"software": 1, "peer": 1}
    assert r.restores == {"memory": 1, "peer": 1} and r.checkpoint_restore.max == 0.5


def test_lanes_and_markers_follow_the_rounds() -> None:
    r = analyze(failed_and_restored())
    n2 = [(s.start, s.end, s.state) for s in r.spans if s.node == "n2"]
    assert n2 == [
        (1.0, 2.0, LaneState.RENDEZVOUS),
        (2.0, 3.0, LaneState.RESTARTING),
        (3.0, 11.0, LaneState.TRAINING),
        (11.0, 13.0, LaneState.RENDEZVOUS),
        (13.0, 14.0, LaneState.RESTARTING),
        (14.0, 21.0, LaneState.TRAINING),
    ]
    assert [(m.time, m.node, m.kind) for m in r.markers] == [(11.5, "n2", "failure")]
    assert [(n.node, n.ranks, n.failures, n.state) for n in r.nodes] == [
        ("n1", {1: 0, 2: 0}, {"peer": 1}, LaneState.TRAINING),
        ("n2", {1: 1, 2: 1}, {"software": 1}, LaneState.TRAINING),
    ]


def test_checkpoint_blocking_is_taken_out_of_the_step_time_and_charged() -> None:
    events = [
        ev(0, "job_started", job_id="1"),
        ev(1, "rendezvous_complete", round=1, nodes=["n1"]),
        *progress(1, (2, 0), (4, 10), (6, 20), (8, 30), (10, 40)),
        # steps 20 and 30 were saved: 0.5 s of blocking each (the slowest rank's)
        ev(5.9, "checkpoint_saved", rank=0, node="n1", step=20, storage="memory", blocking_s=0.5),
        ev(5.9, "checkpoint_saved", rank=1, node="n1", step=20, storage="memory", blocking_s=0.2),
        ev(7.9, "checkpoint_saved", rank=0, node="n1", step=30, storage="memory", blocking_s=0.5),
        ev(10, "job_finished", exit_code=0),
    ]
    r = analyze(events)
    # intervals after the first: 2 s for 10 steps less 0.5 s blocking (twice), 2 s once
    assert r.ideal_step_s == pytest.approx(0.15)
    assert r.lost_s[Cause.CHECKPOINT_BLOCKING] == pytest.approx(1.0)
    assert r.checkpoint_save.count == 2 and r.checkpoint_save.max == 0.5
    assert r.useful_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)


def test_waiting_for_a_replacement_hangs_and_network_checks_are_their_own_causes() -> None:
    events = [
        ev(0, "job_started", job_id="1"),
        ev(4, "netcheck_result", round=1, final=True, faulty=[], seconds=2.0),
        ev(5, "rendezvous_complete", round=1, nodes=["n1", "n2"]),
        *progress(1, (6, 0), (8, 10), (10, 20)),
        ev(20, "hang_detected", ranks=[0, 1], suspected_node="n2", why="its process is stopped"),
        ev(21, "node_lost", node="n2", reason="link timed out"),
        ev(22, "replacement_requested", count=1, exclude=["n2"]),
        ev(40, "node_joined", node="n3", agent="n3-3"),
        ev(41, "rendezvous_complete", round=2, nodes=["n1", "n3"]),
        *progress(2, (42, 20), (44, 30), (46, 40)),
        ev(46.5, "job_finished", exit_code=0),
    ]
    r = analyze(events)
    lost = r.lost_s
    assert lost[Cause.NETWORK_CHECK] == pytest.approx(2.0)
    assert lost[Cause.START_UP] == pytest.approx(4.0)  # 6 s less the check
    assert lost[Cause.HANGS] == pytest.approx(10.0)  # the last step at 10, detected at 20
    assert lost[Cause.WAITING_FOR_NODES] == pytest.approx(19.0)  # requested at 22, round at 41
    assert lost[Cause.RENDEZVOUS] == pytest.approx(2.0)  # 20-22
    assert lost[Cause.RESTARTS] == pytest.approx(1.0)  # round 2 formed to its training
    assert r.membership_changes == 1
    n2 = [(s.state, s.end) for s in r.spans if s.node == "n2"]
    assert n2[-1] == (LaneState.LOST, 46.5)
    n3 = [s.state for s in r.spans if s.node == "n3"]
    assert n3 == [LaneState.RENDEZVOUS, LaneState.RESTARTING, LaneState.TRAINING]
    assert {m.kind for m in r.markers} == {"hang", "lost"}


def test_a_running_job_ends_at_its_newest_step_and_the_master_can_fold_as_it_goes() -> None:
    events = failed_and_restored()[:-1]
    a = Analysis()
    for e in events[:9]:
        a.add(e)
    early = a.report(now=T0 + 11.2, lanes=False)
    assert not early.finished and early.wall_s == 11.0  # training: to its newest step
    a.add(events[9])  # a failure: the wall runs to now
    assert a.report(now=T0 + 12.0).wall_s == 12.0
    for e in events[10:]:
        a.add(e)
    later = a.report(now=T0 + 100)
    assert later.wall_s == 20.0 and later.steps == 60 and later.spans


def test_a_log_without_progress_events_counts_the_saved_steps() -> None:
    events = [
        ev(0, "job_started", job_id="1"),
        ev(1, "rendezvous_complete", round=1, nodes=["n1"]),
        *[
            ev(2 + i, "checkpoint_saved", rank=0, node="n1", step=5 * i, blocking_s=0.0)
            for i in range(11)
        ],
        ev(13, "job_finished", exit_code=0),
    ]
    r = analyze(events)
    assert r.steps == 50 and r.ideal_step_s == pytest.approx(0.2)
    assert r.goodput == pytest.approx(50 * 0.2 / 13, abs=1e-4)


def test_read_events_names_the_bad_line_and_skips_a_torn_last_one(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good = json.dumps(ev(0, "job_started", job_id="1"))
    path.write_text(f"{good}\n{good[:20]}\n")
    assert len(list(read_events(path))) == 1  # a writer died mid-line
    path.write_text(f"{good}\nnot json\n{good}\n")
    with pytest.raises(ReportError, match=r"events.jsonl:2: not an event"):
        list(read_events(path))
    with pytest.raises(ReportError, match="does not exist; pass --job-dir"):
        list(read_events(tmp_path / "nope.jsonl"))
    # What the fast parser refuses and json reads, reads as before: NaN, bytes not UTF-8.
    odd = b'{"time": 1.0, "event": "x", "v": NaN}\n{"time": 2.0, "event": "y", "s": "\xff"}\n'
    path.write_bytes(odd)
    nan, latin = read_events(path)
    assert nan["v"] != nan["v"] and latin["s"] == "\ufffd"
    with pytest.raises(ReportError, match="no job_started event"):
        analyze([ev(0, "node_joined", node="n1")])


def test_a_restore_newer_than_the_last_report_counts_the_steps_in_between() -> None:
    """Progress is reported every few seconds: round 1 was last heard at step 10 but trained
    on to step 30 (the checkpoint round 2 restored) before it failed."""
    events = [
        ev(0, "job_started", job_id="1"),
        ev(1, "rendezvous_complete", round=1, nodes=["n1"]),
        *progress(1, (2, 0), (3, 5), (4, 10)),
        ev(9, "worker_failed", node="n1", rank=0, signal="SIGKILL", classification="software"),
        ev(10, "rendezvous_complete", round=2, nodes=["n1"], restart_count=1),
        ev(11, "checkpoint_restored", node="n1", rank=0, step=30, source="memory", restore_s=0.1),
        *progress(2, (11, 30), (12, 35), (13, 40), (14, 45)),
        ev(14, "job_finished", exit_code=0, restart_count=1),
    ]
    r = analyze(events)
    assert (r.steps, r.redone_steps, r.ideal_step_s) == (45, 0, pytest.approx(0.2))
    # round 1's stretch runs on to about step 30 (4 s + 20 steps x 0.2 s), not its last report
    n1 = [(s.start, s.end, s.state) for s in r.spans if s.state is LaneState.TRAINING]
    assert n1[0] == (2.0, 8.0, LaneState.TRAINING)
    assert r.useful_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)


def test_a_rejected_restore_is_a_marker_on_its_node() -> None:
    log = failed_and_restored()
    rejected = ev(
        13.9,
        "restore_rejected",
        node="n1",
        rank=0,
        step=40,
        source="memory",
        why="non-finite values in model.0.weight (1 of 2048: nan)",
        next_step=30,
    )
    log.insert(-6, rejected)
    r = analyze(log)
    assert [(m.time, m.node, m.kind, m.label) for m in r.markers] == [
        (11.5, "n2", "failure", "rank 1 SIGKILL (software)"),
        (
            13.9,
            "n1",
            "checkpoint",
            "step 40 rejected (memory): non-finite values in model.0.weight (1 of 2048: nan)",
        ),
    ]


def test_a_crash_loop_is_named_with_its_repeated_failure() -> None:
    segv = "the worker crashed with SIGSEGV; no hardware error was logged"
    events = [
        ev(0, "job_started", job_id="9", nnodes="2:2"),
        *(
            ev(2 * r, "rendezvous_complete", round=r, nodes=["n1", "n2"], restart_count=r - 1)
            for r in (1, 2, 3, 4)
        ),
        ev(9, "crash_loop", rounds=3, rank=0, node="n1", classification="software", error=segv),
        ev(9, "job_finished", exit_code=3, restart_count=3),
    ]
    report = analyze(events)
    assert report.exit_code == 3
    assert report.repeated_failure == (
        f"3 rounds in a row failed without progress, first on rank 0 of n1 (software): {segv}"
    )
    console = Console(width=300, record=True)
    print_report(report, console)
    assert "crash loop: 3 rounds in a row failed without progress, first on rank 0" in (
        console.export_text()
    )
    assert analyze(failed_and_restored()).repeated_failure == ""


def test_storage_stalls_are_on_the_timeline_and_in_the_checkpoint_table() -> None:
    log = failed_and_restored()
    path = "/shared/ckpt/checkpoint-20.pt"
    stall = {"path": path, "step": 20, "since": T0 + 6.0}
    log[6:6] = [
        ev(11, "persist_stalled", node="n1", seconds=5.0, ongoing=True, **stall),
        ev(11.2, "persist_stalled", node="n2", seconds=5.2, ongoing=True, **stall),
    ]
    log.insert(-3, ev(16, "persist_stalled", node="n1", seconds=10.0, ongoing=False, **stall))
    r = analyze(log)
    assert [(s.node, s.start, s.seconds, s.ongoing) for s in r.storage_stalls] == [
        ("n1", 6.0, 10.0, False),
        ("n2", 6.0, 5.2, True),  # the log ends with n2's persist still waiting
    ]
    storage = [(m.time, m.node, m.label) for m in r.markers if m.kind == "storage"]
    assert storage == [
        (6.0, "n1", f"storage stalled ({path})"),
        (6.0, "n2", f"storage stalled ({path})"),
        (16.0, "n1", "storage answered after 10 s"),
    ]
    console = Console(width=300, record=True)
    print_report(r, console)
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert "storage stalls: 2, longest 10 s on n1 at +6 s (still stalled)" in text
    assert analyze(failed_and_restored()).storage_stalls == []
