"""The agent's watchdog against real worker processes: progress records in /dev/shm, stacks
read with py-spy (and faulthandler when py-spy cannot), a SIGSTOPped worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover_hpc.agent import watchdog as wd
from dlrover_hpc.diagnosis import stacks as st
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.worker import membership, progress

WORKER = """
import sys, time
from dlrover_hpc.worker import hooks as worker_hooks
from dlrover_hpc.worker import membership, progress
worker_hooks.install()

def wait_in_collective():
    while True:
        time.sleep(0.05)

def train(steps):
    for _ in range(steps):
        time.sleep(0.05)
        progress.step()
    wait_in_collective()

train(int(sys.argv[1]))
"""


def _start(tmp_path: Path, steps: int, local_rank: int = 0) -> tuple[subprocess.Popen, str]:
    template = wd.progress_template(f"test-{os.getpid()}", tmp_path.name, agent_pid=os.getpid())
    path = template.format(local_rank)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, progress.PATH_ENV: path}
    proc = subprocess.Popen([sys.executable, str(script), str(steps)], env=env)
    return proc, path


def _stop(proc: subprocess.Popen, path: str) -> None:
    proc.kill()
    proc.wait()
    for p in (path, path + ".stack"):
        if os.path.exists(p):
            os.unlink(p)


def test_progress_then_a_stopped_worker_stalls_and_its_stack_shows_where(tmp_path: Path) -> None:
    proc, path = _start(tmp_path, steps=30)
    try:
        dog = wd.Watchdog(sample_s=0.3)
        dog.start_round({0: (4, proc.pid, path)})
        wait_for(
            lambda: (r := progress.read(path)) is not None and r.step >= 5,
            timeout_s=20,
            what="5 steps",
        )
        [p] = dog.poll()
        assert p.rank == 4 and p.step >= 5 and p.stalled_s < 1.0
        record = progress.read(path)
        assert record is not None and record.pid == proc.pid
        wait_for(lambda: getattr(progress.read(path), "step", 0) == 30, timeout_s=20, what="30")
        dog.poll()
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(4):  # stacks sampled while the steps stall: always the same one
            time.sleep(0.4)
            [p] = dog.poll()
        assert p.step == 30 and p.stalled_s >= 1.5
        [row] = dog.dump("nodeX")
        assert (row.rank, row.node, row.pid, row.status) == (4, "nodeX", proc.pid, "stopped")
        stack = st.from_json(row.stack)
        assert stack is not None
        assert [f.function for f in stack.signature()][:2] == ["wait_in_collective", "train"]
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc, path)
    dog.stop_round()
    assert not os.path.exists(path)


def test_a_worker_stopped_throughout_is_told_from_one_stopped_and_continued_in_turn(
    tmp_path: Path,
) -> None:
    proc, path = _start(tmp_path, steps=3)
    dog = wd.Watchdog(sample_s=60.0)  # no stacks: only the process state is read here
    try:
        dog.start_round({0: (0, proc.pid, path)})
        wait_for(lambda: getattr(progress.read(path), "step", 0) == 3, timeout_s=20, what="3")
        [p] = dog.poll()
        assert p.stopped_s == 0.0
        # throttled: stopped at every sight, but it runs in between
        for _ in range(6):
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.15)
            [p] = dog.poll()
            assert p.stopped_s < 0.1, p
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        # stopped for good: the time since it was first seen so
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        dog.poll()
        time.sleep(1.0)
        [p] = dog.poll()
        assert p.stopped_s >= 0.9
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.1)
        [p] = dog.poll()
        assert p.stopped_s == 0.0
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc, path)
        dog.stop_round()


def test_a_stop_past_the_bound_asks_for_one_early_heartbeat_per_stop(tmp_path: Path) -> None:
    """The agent's quick look (every 0.25 s): true once a worker has been stopped for the
    bound throughout, once per stop; never for one stopped and continued in turn."""
    proc, path = _start(tmp_path, steps=3)
    dog = wd.Watchdog(sample_s=60.0)
    try:
        dog.start_round({0: (0, proc.pid, path)})
        wait_for(lambda: getattr(progress.read(path), "step", 0) == 3, timeout_s=20, what="3")
        assert not dog.stopped_past(0.5)
        for _ in range(8):  # throttled for 1.6 s: never 0.5 s throughout
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(0.15)
            assert not dog.stopped_past(0.5)
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        for _ in range(2):  # each stop for good: said once
            os.kill(proc.pid, signal.SIGSTOP)
            seen = []
            for _ in range(8):
                seen.append(dog.stopped_past(0.5))
                time.sleep(0.125)
            assert seen.count(True) == 1 and seen.index(True) >= 3, seen
            [p] = dog.poll()
            assert p.stopped_s >= 0.5  # what that heartbeat says
            os.kill(proc.pid, signal.SIGCONT)
            time.sleep(0.1)
            assert not dog.stopped_past(0.5)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc, path)
        dog.stop_round()


def test_without_py_spy_the_worker_answers_through_faulthandler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc, path = _start(tmp_path, steps=2)
    try:
        wait_for(
            lambda: (r := progress.read(path)) is not None and r.step == 2,
            timeout_s=20,
            what="2 steps",
        )
        reader = wd.StackReader()
        reader.py_spy = None  # as where Yama or a container forbids reading the process
        stack, error = reader.read(proc.pid, path)
        assert error == "" and stack is not None
        assert [f.function for f in stack.signature()][:2] == ["wait_in_collective", "train"]
        assert "cannot read worker stacks with py-spy (py-spy is not installed)" in caplog.text
        os.kill(proc.pid, signal.SIGSTOP)  # a stopped process cannot answer: said so
        stack, error = reader.read(proc.pid, path)
        assert stack is None and "did not answer SIGUSR2" in error
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        _stop(proc, path)


def test_a_stopped_workers_stuck_children_are_reaped(tmp_path: Path) -> None:
    """A data-loader worker blocked in a read never notices its rank is gone: the agent kills
    what the workers left behind once it stopped them."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(3600)'])\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)])
    watchdog = wd.Watchdog(sample_s=1000.0)
    try:
        watchdog.start_round({0: (0, proc.pid, str(tmp_path / "none.progress"))})
        children = wait_for(watchdog.descendants, timeout_s=30, what="the child")
        proc.kill()  # the agent stops the worker; its child lives on, now an orphan
        proc.wait()
        assert all(c.is_running() for c in children)
        assert wd.reap(children) == 1
        wait_for(lambda: not any(c.is_running() for c in children), timeout_s=10, what="reaped")
        assert wd.reap(children) == 0  # gone already: nothing to kill, nothing raised
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_membership_files_round_trip_and_go_with_the_worker(tmp_path: Path) -> None:
    """The agent's notices to in-process workers (issue 26): whole JSON by rename, the
    worker's acknowledgement, and removal with the worker's record."""
    record = str(tmp_path / "rank0.progress")
    assert membership.read_notice(record) is None and membership.left(record) == -1
    assert membership.opted_in(record) is None
    membership.opt_in(record, 4242)
    assert membership.opted_in(record) == 4242
    membership.tell(record, membership.Notice(3, membership.LEAVE))
    assert membership.read_notice(record) == membership.Notice(3, membership.LEAVE, {})
    membership.acknowledge_left(record, 3)
    assert membership.left(record) == 3
    env = {"RANK": "5", "WORLD_SIZE": "6"}
    membership.tell(record, membership.Notice(4, membership.JOIN, env))
    assert membership.read_notice(record) == membership.Notice(4, membership.JOIN, env)
    Path(record + membership.NOTICE_SUFFIX).write_text('{"round": 5, "pha')  # not ours: torn
    assert membership.read_notice(record) is None
    membership.clear(record)
    assert not list(tmp_path.iterdir())


def test_a_worker_that_exited_while_its_round_goes_on_is_reported_as_ending(
    tmp_path: Path,
) -> None:
    """The master gives the job its ending bound (no hang while peers tear down)."""
    proc, path = _start(tmp_path, steps=2)
    dog = wd.Watchdog(sample_s=60.0)
    try:
        dog.start_round({0: (0, proc.pid, path)})
        wait_for(lambda: getattr(progress.read(path), "step", 0) == 2, timeout_s=20, what="2")
        [p] = dog.poll()
        assert p.section == "", p
        proc.terminate()
        proc.wait()
        [p] = dog.poll()
        assert p.section == "exit" and p.stalled_s < 1.0, p
        time.sleep(0.3)
        [p] = dog.poll()  # the section stays, the time in it grows
        assert p.section == "exit" and p.stalled_s >= 0.3, p
    finally:
        _stop(proc, path)
        dog.stop_round()


def test_a_worker_that_computes_is_working_one_that_waits_is_not() -> None:
    """Issue 45: CPU time that grows over a window is work (an evaluation without steps); a
    process blocked in a wait (a collective, a join) is not."""
    from dlrover_hpc.agent.watchdog import WORK_WINDOW_S, Watchdog, _Rank

    # as a training rank has a core of its own: a suite's other jobs must not starve it
    busy = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=(lambda: os.nice(-10)) if os.geteuid() == 0 else None,
    )
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ranks = [_Rank(0, busy.pid, "/nonexistent"), _Rank(1, idle.pid, "/nonexistent")]
        t0 = time.monotonic()
        for r in ranks:
            Watchdog._read_work(r, t0)
        assert not any(r.working for r in ranks)  # one reading: no window yet
        time.sleep(WORK_WINDOW_S + 0.3)
        now = time.monotonic()
        for r in ranks:
            Watchdog._read_work(r, now)
        assert ranks[0].working and not ranks[1].working
        assert not ranks[0].cuda
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
