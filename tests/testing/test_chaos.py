"""The chaos stream: the seeded plan, the analysis of a job's logs, and a slow node's throttle
(real processes)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time

import psutil
import pytest
from harness import chaos
from harness.chaos import FaultKind, analyze, plan


def test_plan_is_seeded_spaced_and_covers_every_kind() -> None:
    faults = plan(1, duration_s=600, every_s=50)
    assert faults == plan(1, duration_s=600, every_s=50)
    assert faults != plan(2, duration_s=600, every_s=50)
    assert 10 <= len(faults) <= 15 and faults[-1].at_s <= 600
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(faults)]
    assert all(39.9 <= g <= 60.1 for g in gaps)
    assert {f.kind for f in faults[: len(FaultKind)]} == set(FaultKind)


def _events() -> list[dict]:
    return [
        {"time": 100.0, "event": "job_started"},
        {"time": 104.9, "event": "checkpoint_saved", "step": 5},
        {"time": 106.0, "event": "checkpoint_restored", "source": "memory", "step": 5},
        {"time": 106.0, "event": "checkpoint_restored", "source": "peer", "step": 5},
        {"time": 120.0, "event": "job_finished"},
    ]


def test_analyze_goodput_stalls_and_lost_steps() -> None:
    # 1 s per step from t=101; a fault at 105.5 after step 6; back at 110 from step 5 (redone 6)
    timing = [(100.0 + s, s) for s in range(1, 7)] + [
        (110.0 + i, s) for i, s in enumerate(range(6, 16))
    ]
    faults = [{"time": 105.5, "kind": "agent_kill", "node": "node3"}]
    r = analyze(_events(), timing, faults)
    assert r.ideal_step_s == pytest.approx(1.0)
    assert r.steps == 15 and r.wall_s == pytest.approx(20.0)
    assert r.goodput == pytest.approx(15 / 20)
    assert r.stalls == [
        {"start": 0.0, "seconds": 1.0, "cause": "start-up"},
        {"start": 6.0, "seconds": 4.0, "cause": "agent_kill node3"},
    ]
    assert r.restarts == 1 and r.redone_steps == 1
    assert r.lost_steps == 0  # resumed from step 5, the newest saved before the fault
    assert r.restores == {"memory": 1, "peer": 1}
    # Resumed from the next step (saved just before the fault): the master's event counts it.
    seamless = [(100.0 + s, s) for s in range(1, 7)] + [
        (110.0 + i, s) for i, s in enumerate(range(7, 16))
    ]
    restarted = [*_events()[:-1], {"time": 109.0, "event": "workers_restarted"}, _events()[-1]]
    assert analyze(_events(), seamless, faults).restarts == 0
    assert analyze(restarted, seamless, faults).restarts == 1


def test_analyze_counts_steps_lost_beyond_the_newest_checkpoint() -> None:
    timing = [(100.0 + s, s) for s in range(1, 8)] + [(112.0, 1), (113.0, 2)]
    r = analyze(_events(), timing)
    assert r.redone_steps == 7 and r.lost_steps == 5  # step 5 was saved, restarted from 0


def test_a_long_stall_lists_what_the_job_did_meanwhile() -> None:
    # a 30 s gap after step 6: a node lost, a round, workers started; routine events left out
    timing = [(100.0 + s, s) for s in range(1, 7)]
    timing += [(136.0 + i, s) for i, s in enumerate(range(6, 10))]
    events = [
        {"time": 100.0, "event": "job_started"},
        {"time": 104.9, "event": "checkpoint_saved", "step": 5},
        {"time": 110.0, "event": "node_lost", "node": "node2"},
        {"time": 112.0, "event": "checkpoint_persisted", "node": "node1"},
        {"time": 130.0, "event": "rendezvous_complete", "round": 2},
        {"time": 131.0, "event": "workers_started", "node": "node1"},
        {"time": 140.0, "event": "job_finished"},
    ]
    [_, long] = analyze(events, timing).stalls
    assert long["seconds"] == pytest.approx(30.0)
    assert long["events"] == [
        "+10.0 node_lost node2",
        "+30.0 rendezvous_complete",
        "+31.0 workers_started node1",
    ]


def test_a_slow_node_throttles_the_next_training_process_once_the_first_ended() -> None:
    """The node is slow, not one process: after the job restarts the node's workers, the new
    one is throttled in its place (the soak's slow node was healed by any restart before)."""

    def sleeper() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    first, second = sleeper(), sleeper()
    current = {"pid": None}  # no training process found at first, between two rounds
    stop = threading.Event()
    thread = threading.Thread(
        target=chaos.throttle, args=(first.pid, lambda: current["pid"], stop), daemon=True
    )
    try:
        thread.start()

        def stopped_once(pid: int) -> bool:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                    return True
                time.sleep(0.02)
            return False

        assert stopped_once(first.pid)
        first.kill()
        first.wait()
        time.sleep(3 * chaos.SLOW_PERIOD_S)  # nothing to throttle: it waits
        assert psutil.Process(second.pid).status() != psutil.STATUS_STOPPED
        current["pid"] = second.pid
        assert stopped_once(second.pid)
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        time.sleep(0.1)
        assert psutil.Process(second.pid).status() != psutil.STATUS_STOPPED  # continued
    finally:
        stop.set()
        for p in (first, second):
            p.kill()
            p.wait()
