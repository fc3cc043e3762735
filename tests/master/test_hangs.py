"""Hangs and stragglers at the master, driven through the real Job with agents answering
DumpStacks as they would; real files, only the clock is ours."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from dlrover_hpc.diagnosis import stacks as st
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master import hangs
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.protocol import messages as m

from .test_job import Harness, run


def _stack(*frames: str) -> list[dict]:
    thread = st.Thread("MainThread", tuple(st.Frame(f, "train.py", 9) for f in frames), True)
    return st.to_json(st.Stack((thread,)))


def test_no_progress_anywhere_is_a_hang_one_progressing_rank_is_not() -> None:
    p = [
        m.RankProgress(rank=0, step=5, stalled_s=18.0),
        m.RankProgress(rank=1, step=5, stalled_s=25),
    ]
    assert not hangs.hung_ranks([(p[0], 10.0), (p[1], 10.0)], now=11.0, timeout_s=20)
    assert hangs.hung_ranks([(p[0], 10.0), (p[1], 10.0)], now=12.0, timeout_s=20) == hangs.Bound(
        20.0, "--hang-timeout"
    )
    assert not hangs.hung_ranks([], now=99.0, timeout_s=20)


AUTO = -1.0


def _p(rank: int, stalled: float, *, p99: float = 0.5, **kw: object) -> m.RankProgress:
    return m.RankProgress(rank=rank, step=5, stalled_s=stalled, p99_s=p99, **kw)  # type: ignore[arg-type]


def test_auto_bounds_come_from_the_step_times_sections_and_warm_up() -> None:
    bound = hangs.rank_bound
    # 2 x p99 + 10 s of the job's slowest rank, at least 30 s
    assert bound(_p(0, 0), timeout_s=AUTO, p99_s=0.5) == hangs.Bound(30.0, "step statistics")
    assert bound(_p(0, 0), timeout_s=AUTO, p99_s=20.0) == hangs.Bound(50.0, "step statistics")
    # a section has its own bound, or the script's
    assert bound(_p(0, 0, section="eval"), timeout_s=AUTO, p99_s=0.5) == hangs.Bound(
        600.0, "section eval"
    )
    assert bound(_p(0, 0, section="data"), timeout_s=AUTO, p99_s=0.5).seconds == 300.0
    mine = _p(0, 0, section="mine", section_bound_s=45.0)
    assert bound(mine, timeout_s=AUTO, p99_s=0.5) == hangs.Bound(45.0, "section mine")
    # before the rank has a p99: the first steps (compilation, warm-up, restore)
    assert bound(_p(0, 0, p99=0.0), timeout_s=AUTO, p99_s=0.5) == hangs.Bound(600.0, "warm-up")
    # never past the ceiling; a number is a fixed bound for everything
    assert bound(_p(0, 0), timeout_s=AUTO, p99_s=5000.0) == hangs.Bound(1800.0, "ceiling")
    assert bound(_p(0, 0, section="eval"), timeout_s=20.0, p99_s=0.5) == hangs.Bound(
        20.0, "--hang-timeout"
    )


def test_a_job_ending_is_no_hang_until_the_ending_bound() -> None:
    """Seen in the framework matrix: a rank exited (its training done) while a peer stayed in
    its teardown for 30 s; with the step-statistics bound that was a hang, and a restart."""
    stalled = [(_p(0, 31.0), 10.0), (_p(1, 31.0), 10.0)]
    assert hangs.hung_ranks(stalled, now=10.0, timeout_s=AUTO) == hangs.Bound(
        30.0, "step statistics"
    )
    # a node finished (the master's table), or the agent saw a rank's process exit
    assert not hangs.hung_ranks(stalled, now=10.0, timeout_s=AUTO, ending=True)
    gone = [(_p(0, 31.0), 10.0), (_p(1, 31.0, section="exit"), 10.0)]
    assert not hangs.hung_ranks(gone, now=10.0, timeout_s=AUTO)
    # a teardown that never ends is still found, after the ending bound
    assert hangs.hung_ranks(gone, now=10.0 + hangs.ENDING_BOUND_S, timeout_s=AUTO) == (
        hangs.Bound(hangs.ENDING_BOUND_S, "job ending")
    )
    # a fixed --hang-timeout stays what the user asked for
    assert hangs.hung_ranks(stalled, now=10.0, timeout_s=20.0, ending=True)


def test_a_rank_within_its_section_bound_keeps_the_job_from_a_hang() -> None:
    waiting = [(_p(0, 31.0), 10.0), (_p(1, 31.0), 10.0)]
    assert hangs.hung_ranks(waiting, now=10.0, timeout_s=AUTO) == hangs.Bound(
        30.0, "step statistics"
    )
    # a learned bound is when hang_detected is out: the check fires DETECT_SLACK_S before
    early = [(_p(0, 27.5), 10.0), (_p(1, 27.5), 10.0)]
    assert hangs.hung_ranks(early, now=10.0, timeout_s=AUTO) == hangs.Bound(30.0, "step statistics")
    assert hangs.hung_ranks(early, now=9.0, timeout_s=AUTO) is None
    # rank 2 evaluates alone while the others wait in a barrier: no hang for 600 s
    evaluating = [*waiting, (_p(2, 31.0, section="eval"), 10.0)]
    assert hangs.hung_ranks(evaluating, now=10.0, timeout_s=AUTO) is None
    assert hangs.hung_ranks(evaluating, now=580.0, timeout_s=AUTO) == hangs.Bound(
        600.0, "section eval"
    )
    assert hangs.hung_ranks(waiting, now=10.0, timeout_s=0.0) is None  # off
    # busy in its section (its CPU counts as progress), but open past the 1800 s ceiling
    spinning = [*waiting, (_p(2, 0.0, section="eval", section_s=1700.0), 10.0)]
    assert hangs.hung_ranks(spinning, now=10.0, timeout_s=AUTO) is None
    assert hangs.hung_ranks(spinning, now=110.0, timeout_s=AUTO) is not None
    # not with a fixed timeout, nor for a section the script bounded itself
    long_eval = [(_p(r, 31.0, section="eval", section_s=1801.0), 10.0) for r in range(2)]
    assert hangs.hung_ranks(long_eval, now=10.0, timeout_s=7200.0) is None
    own = [(_p(0, 0.0, section="export", section_s=1801.0, section_bound_s=3600.0), 10.0)]
    assert hangs.hung_ranks(own, now=10.0, timeout_s=AUTO) is None
    assert hangs.rank_bound(own[0][0], timeout_s=AUTO, p99_s=0.5) == hangs.Bound(
        3600.0, "section export"
    )


def test_a_rank_stopped_by_a_signal_is_a_hang_at_once_with_auto_alone() -> None:
    stopped = _p(1, 1.0, stopped_s=1.0)
    bound = hangs.STOPPED_BOUND_S
    assert bound == 2.0  # SIGSTOP for 2 s throughout: nothing legitimate does that
    # the others still step (or only just began to wait for it): 2 s stopped is enough
    job = [(_p(0, 0.2), 10.0), (stopped, 10.0)]
    assert hangs.hung_ranks(job, now=10.0 + bound - 1.5, timeout_s=AUTO) is None
    assert hangs.hung_ranks(job, now=10.0 + bound - 1.0, timeout_s=AUTO) == hangs.Bound(
        hangs.STOPPED_BOUND_S, "stopped process"
    )
    # in its evaluation, its warm-up or its checkpoint alike
    in_eval = [(_p(0, 0.2), 10.0), (_p(1, 1.0, section="eval", stopped_s=11.0), 10.0)]
    assert hangs.hung_ranks(in_eval, now=10.0, timeout_s=AUTO) is not None
    # a fixed --hang-timeout is the user's bound for everything; not stopped: no such rule
    assert hangs.hung_ranks(job, now=16.0, timeout_s=900.0) is None
    assert (
        hangs.hung_ranks([(_p(0, 0.2), 10.0), (_p(1, 9.0), 10.0)], now=16.0, timeout_s=AUTO) is None
    )


def test_the_master_takes_a_fixed_timeout_over_auto_and_auto_over_off(tmp_path: Path) -> None:
    h = Harness(tmp_path, nnodes="1:3")
    watch = HangWatch(h.job, lambda a, msg: None, tmp_path)
    assert watch.timeout_s == 0.0
    join = m.Join(node="n1", addr="a", nproc=1)
    watch.joined(dataclasses.replace(join, hang_timeout_s=0.0))
    assert watch.timeout_s == 0.0
    watch.joined(dataclasses.replace(join, hang_timeout_s=AUTO))
    assert watch.timeout_s == AUTO
    watch.joined(dataclasses.replace(join, hang_timeout_s=0.0))
    assert watch.timeout_s == AUTO
    watch.joined(dataclasses.replace(join, hang_timeout_s=60.0))
    watch.joined(dataclasses.replace(join, hang_timeout_s=AUTO))
    assert watch.timeout_s == 60.0


def test_a_rank_whose_compute_holds_its_peers_back_is_a_straggler() -> None:
    # rank 3 computes 0.35 s a step; the others 0.1 s, then wait 0.25 s for it
    lockstep = {0: (0.1, 0.25), 1: (0.11, 0.24), 2: (0.1, 0.25), 3: (0.35, 0.0)}
    assert hangs.stragglers(lockstep, 2.0) == {3: hangs.Slow(3.5, 0.35, 0.1, 0.25)}
    assert hangs.stragglers({0: (0.1, 0.05), 1: (0.15, 0.0)}, 2.0) == {}  # under the factor
    assert hangs.stragglers({0: (0.1, 0.0), 1: (0.0, 0.0)}, 2.0) == {}  # no timing: never
    # slower, but nobody waits for it: not lockstep (its own pace), nobody is held back
    assert hangs.stragglers({0: (0.1, 0.0), 1: (0.1, 0.0), 2: (0.35, 0.0)}, 2.0) == {}
    # tiny steps: 3x of almost nothing is noise
    assert hangs.stragglers({0: (0.002, 0.004), 1: (0.002, 0.004), 2: (0.006, 0.0)}, 2.0) == {}


def _ranks(h: Harness, agent: str) -> list[int]:
    """The global ranks of an agent's two workers (the harness's nodes run two each)."""
    rec = h.job.nodes[agent]
    assert rec.assignment is not None
    return [rec.assignment.rank_offset + lr for lr in range(rec.nproc)]


class Agents:
    """Answers the master's DumpStacks as agents would; rank 3 is stopped."""

    def __init__(self, h: Harness, watch: HangWatch) -> None:
        self.h, self.watch = h, watch

    def push(self, agent: str, msg: m.Message) -> None:
        self.h.pushed.append((agent, msg))
        if isinstance(msg, m.DumpStacks):
            node = self.h.job.nodes[agent].node
            rows = [
                m.RankStackRow(
                    rank=rank,
                    node=node,
                    pid=1000 + rank,
                    status="stopped" if rank == 3 else "sleeping",
                    step=41 if rank == 3 else 42,
                    stack=_stack("step", "train") if rank == 3 else _stack("all_reduce", "train"),
                )
                for rank in _ranks(self.h, agent)
            ]
            reply = m.StacksDumped(agent_id=agent, request_id=msg.request_id, ranks=rows)
            asyncio.get_running_loop().call_soon(self.watch.stacks_dumped, reply)


def _watch(h: Harness, tmp: Path) -> HangWatch:
    watch = HangWatch(h.job, lambda a, msg: None, tmp)
    agents = Agents(h, watch)
    watch._push = agents.push  # the server's push, as the agents see it
    watch.timeout_s = 20.0
    return watch


def _beat(h: Harness, watch: HangWatch, agents: list[str], stalled: float) -> None:
    for agent in agents:
        progress = [
            m.RankProgress(rank=rank, step=41 if rank == 3 else 42, stalled_s=stalled)
            for rank in _ranks(h, agent)
        ]
        watch.heartbeat(h.job.nodes[agent].node, progress)


def test_a_hang_dumps_every_stack_names_the_stopped_rank_and_restarts(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        _beat(h, watch, agents, stalled=5.0)
        watch.check()
        assert h.job.phase is Phase.RUNNING and not h.events("hang_detected")
        _beat(h, watch, agents, stalled=21.0)
        watch.check()
        await asyncio.wait_for(watch._task, 5)  # type: ignore[arg-type]
        [hang] = h.events("hang_detected")
        assert hang["suspected_rank"] == 3 and hang["why"] == "its process is stopped"
        assert hang["suspected_node"] == "n2" and hang["frame"] == "all_reduce <- train"
        assert hang["last_step"] == {"0": 42, "1": 42, "2": 42, "3": 41}
        assert hang["ranks"] == [0, 1, 2, 3]
        assert hang["bound_s"] == 20.0 and hang["bound_from"] == "--hang-timeout"
        directory = Path(hang["directory"])
        assert directory.parent == tmp_path / "hangs"
        names = sorted(p.name for p in directory.iterdir())
        assert names == ["merged.txt", "rank-0.txt", "rank-1.txt", "rank-2.txt", "rank-3.txt"]
        merged = (directory / "merged.txt").read_text()
        assert "suspect: rank 3 (its process is stopped)" in merged
        assert "ranks 0-2 on n1,n2: all_reduce <- train" in merged
        assert "status stopped step 41" in (directory / "rank-3.txt").read_text()
        assert h.job.phase is Phase.RESTARTING and h.job.restart_count == 1

    run(body)


def test_the_ended_rounds_heartbeats_raise_no_second_hang_in_the_next(tmp_path: Path) -> None:
    """Heartbeats of the hung round's workers still come while the next round forms; once it
    runs, the watch must not judge its workers by them (seen in a clean-clone run: a second
    hang_detected 0.4 s into the new round, the stale stopped rank its cause)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        _beat(h, watch, agents, stalled=21.0)
        watch.check()
        await asyncio.wait_for(watch._task, 5)  # type: ignore[arg-type]
        assert h.job.phase is Phase.RESTARTING and len(h.events("hang_detected")) == 1
        _beat(h, watch, agents, stalled=23.0)  # the old round's workers, still reported
        for agent in agents:
            h.wait(agent, after=1)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 2)
        watch.check()
        assert watch._task is None or watch._task.done()
        assert len(h.events("hang_detected")) == 1

    run(body)


def test_a_second_hang_on_the_same_node_excludes_it(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="1:3", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        watch.hangs_by_node["n2"] = 1  # an earlier hang was blamed on it
        _beat(h, watch, agents, stalled=30.0)
        watch.check()
        await asyncio.wait_for(watch._task, 5)  # type: ignore[arg-type]
        assert h.job.nodes[agents[1]].state is NodeState.EXCLUDED
        assert h.removed and h.removed[0][0] == "n2" and "2 hangs blamed on it" in h.removed[0][1]
        assert h.job.restart_count == 0 and h.job.phase is Phase.SHRINKING

    run(body)


def test_a_second_hang_on_a_node_the_job_cannot_do_without_restarts_it(tmp_path: Path) -> None:
    """Soak seed 1: two stopped workers on node1 of MIN 3 nodes, no spare; excluding it
    stopped the whole job (2 of MIN 3) for 300 s and requeued it.  It restarts instead."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        watch.hangs_by_node["n2"] = 1
        _beat(h, watch, agents, stalled=30.0)
        watch.check()
        await asyncio.wait_for(watch._task, 5)  # type: ignore[arg-type]
        assert h.job.nodes[agents[1]].state is not NodeState.EXCLUDED and not h.removed
        assert h.job.restart_count == 1 and h.job.phase is Phase.RESTARTING

    run(body)


def _timed_beat(
    h: Harness, watch: HangWatch, agents: list[str], step: int, saved: int | list[int] = -1
) -> None:
    """One heartbeat per agent: n3's ranks compute 0.5 s a step, the others 0.1 s and wait;
    each rank saved step ``saved`` (per agent, when a list) to memory last (-1: none)."""
    per_agent = saved if isinstance(saved, list) else [saved] * len(agents)
    timings = ((0.1, 0.4), (0.1, 0.4), (0.5, 0.0))
    for agent, (compute, wait), last_saved in zip(agents, timings, per_agent, strict=True):
        _agent_beat(h, watch, agent, step, compute=compute, wait=wait, saved=last_saved, p99=0.6)


def _agent_beat(
    h: Harness,
    watch: HangWatch,
    agent: str,
    step: int,
    *,
    compute: float,
    wait: float,
    saved: int,
    p99: float,
) -> None:
    """One heartbeat of ``agent``'s ranks at ``step`` (``p99``: past its warm-up, so
    fail-slow evidence counts)."""
    progress = [
        m.RankProgress(
            rank=rank,
            step=step,
            stalled_s=0.0,
            at=1000.0 + step,
            compute_s=compute,
            wait_s=wait,
            saved_step=saved,
            p99_s=p99,
        )
        for rank in _ranks(h, agent)
    ]
    watch.heartbeat(h.job.nodes[agent].node, progress)


def _sustained_straggler(h: Harness, watch: HangWatch, agents: list[str]) -> list[dict]:
    step, deadline = 0, h.clock.now + 200
    while h.clock.now < deadline:
        step += 1
        _timed_beat(h, watch, agents, step)
        watch.check()
        if found := h.events("straggler_detected"):
            return found
        h.clock.now += 1.0
    raise AssertionError("no straggler_detected")


def test_a_sustained_straggler_is_reported_and_swapped_at_the_next_commit(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0  # no spare waits: one node less is still >= MIN
        assert h.job.can_replace
        started = h.clock.now
        found = _sustained_straggler(h, watch, agents)
        # a few samples to fill the window, then the time it must last: 5x its peers is 2.5x
        # the factor, strong evidence, so the shortest window (20 s / 2.5 = 8 s)
        assert hangs.MIN_WINDOW_S <= h.clock.now - started <= hangs.MIN_WINDOW_S + 5
        assert [(e["node"], e["rank"], e["ratio"]) for e in found] == [
            ("n3", 4, 5.0),
            ("n3", 5, 5.0),
        ]
        first = found[0]
        assert first["compute_s"] == 0.5 and first["peers_compute_s"] == 0.1
        assert first["peers_wait_s"] == 0.4 and first["action"] == "swap at the next checkpoint"
        assert first["evidence"]["0"] == {"compute_s": 0.1, "wait_s": 0.4}
        assert first["evidence"]["4"] == {"compute_s": 0.5, "wait_s": 0.0}
        assert h.job.phase is Phase.RUNNING  # not before the next checkpoint
        watch.committed()
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED
        assert h.job.phase is Phase.SHRINKING

    run(body)


def test_a_straggler_is_swapped_once_every_rank_saved_a_newer_step_to_memory(
    tmp_path: Path,
) -> None:
    """The next commit may be many slow steps away; a memory checkpoint every rank took after
    the straggler was found loses nothing at the restart, so its node goes then."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        _sustained_straggler(h, watch, agents)
        found_at = max(s.progress.step for s in watch._seen.values())
        _timed_beat(h, watch, agents, found_at + 1, saved=found_at)  # saved before: not yet
        watch.check()
        assert h.job.phase is Phase.RUNNING
        assert h.job.nodes[agents[2]].state is NodeState.ACTIVE
        # one node's ranks saved a newer step, the others not yet
        _timed_beat(h, watch, agents, found_at + 2, saved=[found_at, found_at, found_at + 2])
        watch.check()
        assert h.job.phase is Phase.RUNNING
        _timed_beat(h, watch, agents, found_at + 3, saved=found_at + 2)
        watch.check()
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED
        assert h.job.phase is Phase.SHRINKING and "n3" not in h.job.excluded_nodes

    run(body)


def test_a_straggler_found_has_every_node_persist_its_next_save_and_goes_at_that_commit(
    tmp_path: Path,
) -> None:
    """The nodes' next memory save is persisted (PersistStep, the step after the newest one
    reported): its commit reaches the master at once, a heartbeat interval before the
    heartbeats that say every rank saved it.  A script without flash checkpoints is asked
    for nothing."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        step, deadline = 0, h.clock.now + 200
        while not h.events("straggler_detected"):
            assert h.clock.now < deadline, "no straggler_detected"
            step += 1
            _timed_beat(h, watch, agents, step, saved=step - step % 5)
            watch.check()
            h.clock.now += 1.0
        asked = [(a, msg) for a, msg in h.pushed if isinstance(msg, m.PersistStep)]
        assert [a for a, _ in asked] == agents, asked
        assert {msg.step for _, msg in asked} == {step + 1}
        assert "n3" in asked[0][1].reason
        assert h.job.phase is Phase.RUNNING  # not before that save commits
        watch.committed()
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED

    run(body)


def test_a_straggler_without_flash_checkpoints_asks_no_persist(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        _sustained_straggler(h, watch, agents)  # saved_step -1: no save to memory
        assert not [msg for _, msg in h.pushed if isinstance(msg, m.PersistStep)]

    run(body)


def test_a_round_that_reopens_while_a_swap_waits_leaves_the_straggler_out(
    tmp_path: Path,
) -> None:
    """A hang's (or any fault's) restart came before the next checkpoint: the straggler's node
    is left out of that restart, not kept for a second one; a checkpoint committed while the
    round re-forms does not drop the swap (the soak lost a slow link's swap that way and ran
    40 s more at a quarter speed)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        _sustained_straggler(h, watch, agents)
        h.job.apply([d.OpenRound(Phase.RESTARTING, "a worker failed")])
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED
        assert "n3" not in h.job.excluded_nodes and h.job.phase is Phase.RESTARTING
        watch.committed()  # nothing pending any more: no second exclusion, no second round
        assert h.job.phase is Phase.RESTARTING

    run(body)


def test_a_commit_while_the_round_reforms_keeps_the_swap_pending(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor, watch.exclude_straggler = 2.0, True
        _sustained_straggler(h, watch, agents)
        h.job.apply([d.OpenRound(Phase.RESTARTING, "a worker failed")])
        # two others are below MIN 3: n3 is not left out of this restart, its swap waits
        assert h.job.nodes[agents[2]].state is NodeState.ACTIVE
        watch.committed()  # while the round forms: the swap must survive it
        assert watch._swap == "n3"
        for agent in agents:
            h.wait(agent, after=1)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 2)
        watch.committed()
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED

    run(body)


def test_without_a_spare_or_a_replacement_a_straggler_leaves_when_the_others_are_faster(
    tmp_path: Path,
) -> None:
    """Slurm gives no replacement and no spare waits, but two of MIN 2 are left: the others
    train on alone at full speed rather than all at the straggler's fifth."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        h.job.can_replace = False
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        assert not h.job.can_swap_out()
        [first, _] = _sustained_straggler(h, watch, agents)
        assert first["action"] == hangs.LEAVE and first["ratio"] == 5.0, first
        assert h.job.phase is Phase.RUNNING  # not before the next checkpoint
        watch.committed()
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED
        assert h.job.phase is Phase.SHRINKING and "n3" not in h.job.excluded_nodes

    run(body)


def test_a_slow_node_leaves_only_when_the_job_is_faster_without_it() -> None:
    assert d.shrink_wins(4, 5.0, min_nodes=3)  # 3 nodes against 4 at a fifth: 0.8
    assert not d.shrink_wins(4, 1.2, min_nodes=3)  # 3 against 4 / 1.2 = 3.33
    assert d.shrink_wins(8, 1.2, min_nodes=1)  # 7 against 6.67
    assert not d.shrink_wins(3, 5.0, min_nodes=3)  # below MIN without it
    assert not d.shrink_wins(4, 0.0, min_nodes=1)  # no slowdown known


def test_without_a_spare_or_room_to_shrink_a_straggler_is_only_reported(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")  # no spare, and one node less is below MIN
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        [first, _] = _sustained_straggler(h, watch, agents)
        assert first["action"] == "reported"
        watch.committed()
        assert h.job.phase is Phase.RUNNING and h.job.nodes[agents[2]].state is NodeState.ACTIVE

    run(body)


def test_a_node_whose_heartbeats_queue_behind_a_slow_link_is_found() -> None:
    rtts = {"n1": 0.0008, "n2": 0.001, "n3": 0.0009, "n4": 0.12}
    assert hangs.slow_links(rtts) == {"n4": hangs.Slow(133.33, 0.12, 0.0009, 0.0)}
    # a few milliseconds of scheduling noise on a loaded machine is not a slow link
    assert hangs.slow_links({"n1": 0.001, "n2": 0.001, "n3": 0.009}) == {}
    assert hangs.slow_links({"n1": 0.5}) == {}  # nobody to compare with


def test_a_sustained_slow_link_is_reported_with_its_round_trips(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        deadline, found = h.clock.now + 120, []
        while h.clock.now < deadline and not found:
            for agent, rtt in zip(agents, (0.001, 0.0012, 0.2), strict=True):
                progress = [
                    m.RankProgress(rank=r, step=1, stalled_s=0.0, p99_s=0.6)
                    for r in _ranks(h, agent)
                ]
                watch.heartbeat(h.job.nodes[agent].node, progress, rtt_s=rtt)
            watch.check()
            found = h.events("straggler_detected")
            h.clock.now += 1.0
        [e] = found
        assert e["node"] == "n3" and e["cause"] == "link" and e["rank"] == 4, e
        assert e["rtt_s"] == 0.2 and e["peers_rtt_s"] == 0.0011 and e["action"] == "reported"
        # ~180x its peers' round trip: strong evidence, the shortest window
        assert hangs.MIN_WINDOW_S <= e["slow_for_s"] <= hangs.MIN_WINDOW_S + 1
        assert e["evidence"] == {
            "n1": {"rtt_s": 0.001},
            "n2": {"rtt_s": 0.0012},
            "n3": {"rtt_s": 0.2},
        }

    run(body)


def test_a_node_whose_tcp_connections_queue_is_found_in_three_heartbeats_and_swapped(
    tmp_path: Path,
) -> None:
    """The agents' TCP round trips (measured on the local Slurm: ~40 ms on the node whose egress
    is rate-limited, ~5 ms on its peers): three readings, not 8-20 s of heartbeat round trips;
    a spare waits, so the node goes at the next step every rank holds in memory."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        agents = h.start("n1", "n2", "n3", "n4")  # n4: the spare
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        training = [a for a in agents if h.job.nodes[a].state is NodeState.ACTIVE]
        slow = training[-1]
        beats, found = 0, []
        while beats < 10 and not found:
            for agent in training:
                progress = [
                    m.RankProgress(rank=r, step=beats, stalled_s=0.0, p99_s=0.6, saved_step=-1)
                    for r in _ranks(h, agent)
                ]
                tcp = 0.04 if agent == slow else 0.005
                node = h.job.nodes[agent].node
                watch.heartbeat(node, progress, rtt_s=0.001, tcp_rtt_s=(tcp, tcp / 2, 3))
            for _ in range(4):  # 2 s heartbeats, the tick every 0.5 s
                watch.check()
                h.clock.now += 0.5
            beats += 1
            found = h.events("straggler_detected")
        [e] = found
        node = h.job.nodes[slow].node
        assert beats == 4, beats  # the warm-up's, then three readings
        assert (e["node"], e["cause"], e["measured"]) == (node, "link", "tcp"), e
        assert (e["rtt_s"], e["peers_rtt_s"], e["ratio"]) == (0.02, 0.0025, 8.0), e  # lowest
        assert e["evidence"][node] == {"tcp_rtt_s": 0.04, "tcp_min_rtt_s": 0.02}
        assert e["action"] == "swap at the next checkpoint" and e["slow_for_s"] == 4.0
        assert h.job.phase is Phase.RUNNING  # no rank holds a step saved since
        for agent in training:
            progress = [
                m.RankProgress(rank=r, step=beats, stalled_s=0.0, p99_s=0.6, saved_step=beats)
                for r in _ranks(h, agent)
            ]
            watch.heartbeat(h.job.nodes[agent].node, progress)
        watch.check()  # now each holds a newer step in memory: the restart loses none
        assert h.job.nodes[slow].state is NodeState.BENCHED

    run(body)


def test_later_rounds_get_a_warm_up_bound_learned_from_the_first() -> None:
    assert hangs.warmup_bound(0.0) == 600.0  # the first round: compilation may take long
    assert hangs.warmup_bound(20.0) == 120.0  # 3 x 20 + 30 = 90, at least 120
    assert hangs.warmup_bound(100.0) == 330.0
    assert hangs.warmup_bound(400.0) == 600.0
    cold = _p(0, 0, p99=0.0)
    assert hangs.rank_bound(cold, timeout_s=AUTO, p99_s=0.5, warmup_s=120.0) == hangs.Bound(
        120.0, "warm-up"
    )


def test_the_watch_measures_a_rounds_warm_up_once(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="1:3")
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        watch.timeout_s = AUTO
        for p99 in (0.0, 0.0, 0.2, 0.2):
            for agent in agents:
                progress = [_p(r, 0.0, p99=p99) for r in _ranks(h, agent)]
                watch.heartbeat(h.job.nodes[agent].node, progress)
            watch.check()
            h.clock.now += 10.0
        assert watch.longest_warmup_s == 20.0  # from the first report to every rank's p99

    run(body)


def test_a_benched_straggler_is_taken_back_only_when_a_round_would_wait_below_min(
    tmp_path: Path,
) -> None:
    """A swapped-out straggler's node is no spare: its agent waits, benched. When a later loss
    leaves fewer than MIN nodes and nobody else to wait for, a round takes it back (a slow
    node trains, a missing one does not; the soak waited 27 s there for a cut link's node)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        _sustained_straggler(h, watch, agents)
        watch.committed()
        n3 = h.job.nodes[agents[2]]
        assert n3.state is NodeState.BENCHED and h.job.phase is Phase.SHRINKING
        # its workers are told to stop now, and its heartbeats say it is no member
        told = [msg for agent, msg in h.pushed if agent == agents[2]]
        assert isinstance(told[-1], m.RoundChanged) and "benched" in told[-1].reason
        assert not h.agents.heartbeat(m.Heartbeat(agent_id=agents[2], round=1)).member
        for agent in agents:
            h.wait(agent, after=1)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 2)
        assert n3.state is NodeState.BENCHED and h.job.spares() == 0  # not a hot spare
        assert not h.job.can_swap_out() or h.job.can_replace
        # n2 is lost: n1 alone is below MIN 2, and nobody else is left to wait for
        h.job.apply([d.MarkLost(agents[1], "connection closed")])
        h.wait(agents[0], after=2)
        h.settle(0.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 3)
        assert n3.state is NodeState.ACTIVE and n3.round == 3
        assert [e["node"] for e in h.events("node_admitted")] == ["n3"]

    run(body)


def _taken_back_at_min(h: Harness, watch: HangWatch) -> tuple[list[str], int]:
    """n3 is benched as a straggler, then n2 is lost: round 3 takes n3 back at MIN 2
    (n1, n3 train).  Returns the agents and a step past every one reported so far."""
    agents = h.start("n1", "n2", "n3")
    watch.straggler_factor = 2.0
    _sustained_straggler(h, watch, agents)
    watch.committed()
    for agent in agents:
        h.wait(agent, after=1)
    h.settle(1.5)
    h.job.apply([d.MarkLost(agents[1], "connection closed")])
    h.wait(agents[0], after=2)
    h.settle(0.5)
    n3 = h.job.nodes[agents[2]]
    assert (h.job.phase, h.job.round, n3.state) == (Phase.RUNNING, 3, NodeState.ACTIVE)
    assert n3.taken_back
    return agents, 100


@pytest.mark.parametrize("pace", [0.5, 0.1])
def test_a_straggler_taken_back_at_min_gives_its_place_to_a_waiting_node(
    tmp_path: Path, pace: float
) -> None:
    """Soak seed 2: a node at a quarter speed was benched, taken back at MIN 3, and when a
    drained node came back the job grew to 4 with the slow node still in (its restart took
    4.7 s, its steps a quarter speed).  Now the scale-up trades it for the waiting node,
    unless its steps since were shown to keep its peers' pace (then the job grows)."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        watch = _watch(h, tmp_path)
        agents, step = _taken_back_at_min(h, watch)
        n1, n3 = (h.job.nodes[a] for a in (agents[0], agents[2]))
        for _ in range(4):  # n3 computes ``pace`` s a step, n1 0.1 s and waits for it
            step += 1
            _agent_beat(h, watch, agents[0], step, compute=0.1, wait=pace - 0.1, saved=-1, p99=0.6)
            _agent_beat(h, watch, agents[2], step, compute=pace, wait=0.0, saved=-1, p99=0.6)
            h.clock.now += 1.0
        assert watch.keeps_pace("n3") is (pace == 0.1) and watch.keeps_pace("n1")
        late = h.join("n4")
        h.wait(late)
        h.settle()
        if pace == 0.1:  # shown healthy since: the job grows to MAX 3 with it
            assert h.job.phase is Phase.RENDEZVOUS and n3.state is NodeState.ACTIVE
            h.rejoin([agents[0], agents[2]])
            h.settle()
            assert (h.job.phase, h.job.round) == (Phase.RUNNING, 4)
            assert sorted(n.node for n in h.job.participants()) == ["n1", "n3", "n4"]
            return
        assert n3.state is NodeState.BENCHED and not n3.taken_back
        assert h.job.phase is Phase.SHRINKING
        told = [msg for agent, msg in h.pushed if agent == agents[2]]
        assert isinstance(told[-1], m.RoundChanged)
        assert "traded for a waiting node" in told[-1].reason
        for agent in (agents[0], agents[2]):  # n3's agent waits on its node, benched
            h.wait(agent, after=3)
        h.settle(0.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 4)
        assert sorted(n.node for n in h.job.participants()) == ["n1", "n4"]
        assert n1.state is NodeState.ACTIVE and n3.state is NodeState.BENCHED
        # a later loss below MIN takes it back again, as before
        h.job.apply([d.MarkLost(late, "connection closed")])
        h.wait(agents[0], after=4)
        h.settle(0.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 5)
        assert n3.state is NodeState.ACTIVE and n3.taken_back

    run(body)


def _paced_straggler(
    h: Harness, watch: HangWatch, pace: dict[str, float], step: int
) -> tuple[list[dict], int]:
    """Heartbeats from the running round's agents until a straggler is reported: each
    agent's ranks compute ``pace[agent]`` s a step and wait for the slowest; returns the
    new straggler_detected events and the step reached."""
    before, deadline = len(h.events("straggler_detected")), h.clock.now + 200
    slowest = max(pace.values())
    while h.clock.now < deadline:
        step += 1
        for agent, compute in pace.items():
            wait = slowest - compute
            _agent_beat(h, watch, agent, step, compute=compute, wait=wait, saved=-1, p99=0.7)
        watch.check()
        if found := h.events("straggler_detected")[before:]:
            return found, step
        h.clock.now += 1.0
    raise AssertionError("no straggler_detected")


def test_at_min_a_much_slower_straggler_is_traded_for_the_benched_one(tmp_path: Path) -> None:
    """Soak seed 1: a node 3.6x slow was benched (the others faster without it); 100 s
    later, at MIN with no spare and no replacement, a node's link made steps 100x slower,
    and it was only reported while the benched node waited idle.  Now the new straggler is
    traded for the benched one (the job runs at its slowest node's pace); one not much
    slower than the benched one was is only reported."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:4")
        agents = h.start("n1", "n2", "n3", "n4")
        h.job.can_replace = False
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        fast = {a: 0.1 for a in agents}
        [first, *_], step = _paced_straggler(h, watch, {**fast, agents[3]: 0.3}, 0)
        assert first["node"] == "n4" and first["action"] == hangs.LEAVE
        watch.committed()
        n4 = h.job.nodes[agents[3]]
        assert n4.state is NodeState.BENCHED
        for agent in agents:  # n4's agent waits on its node, benched
            h.wait(agent, after=1)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 2)
        # n3 twice as slow as n4 was: not enough for a trade
        three = {a: 0.1 for a in agents[:3]}
        [found, *_], step = _paced_straggler(h, watch, {**three, agents[2]: 0.4}, step)
        assert found["node"] == "n3" and found["action"] == "reported", found
        watch.committed()
        assert h.job.phase is Phase.RUNNING and n4.state is NodeState.BENCHED
        # the next round: n2 at 6x, two times slower than n4 was: traded for it
        h.job.apply([d.OpenRound(Phase.RESTARTING, "test: a worker failed")])
        for agent in agents[:3]:
            h.wait(agent, after=2)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 3)
        [found, *_], step = _paced_straggler(h, watch, {**three, agents[1]: 0.6}, step)
        assert found["node"] == "n2"
        assert found["action"] == hangs.TRADE.format(node="n4", ratio=3.0), found
        watch.committed()
        assert h.job.nodes[agents[1]].state is NodeState.BENCHED
        for agent in (agents[0], agents[2]):
            h.wait(agent, after=3)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 4)
        assert sorted(n.node for n in h.job.participants()) == ["n1", "n3", "n4"]

    run(body)


def test_a_round_that_can_wait_for_a_node_does_not_take_a_benched_one(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        h.job.bench("n3", "runtime straggler")
        for agent in agents:
            h.wait(agent, after=1)
        h.settle(1.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 2)
        # n1's workers failed: n2 is still to re-join, so the round waits for it, not for n3
        h.job.apply([d.OpenRound(Phase.RESTARTING, "a worker failed")])
        h.wait(agents[0], after=2)
        h.settle(0.5)
        assert h.job.phase is Phase.RESTARTING
        h.wait(agents[1], after=2)
        h.settle(0.5)
        assert (h.job.phase, h.job.round) == (Phase.RUNNING, 3)
        assert h.job.nodes[agents[2]].state is NodeState.BENCHED

    run(body)


def test_stronger_evidence_needs_a_shorter_window_and_one_spike_does_not_shorten_it() -> None:
    assert hangs.evidence_window([2.1, 2.2, 2.0], 2.0) == pytest.approx(20.0 / 1.05)
    assert hangs.evidence_window([3.5, 3.4, 3.6], 2.0) == pytest.approx(20.0 / 1.75)  # ~11.4 s
    assert hangs.evidence_window([7.0, 9.0, 8.0], 2.0) == hangs.MIN_WINDOW_S  # 20/4: the floor
    assert hangs.evidence_window([48.0] * 5, hangs.LINK_FACTOR) == hangs.MIN_WINDOW_S
    # one wild check among ratios barely past the factor: the median, not the spike
    assert hangs.evidence_window([2.1, 40.0, 2.1, 2.2], 2.0) == pytest.approx(20.0 / 1.075)
    assert hangs.evidence_window([], 2.0) == hangs.STRAGGLER_WINDOW_S
    assert hangs.evidence_window([1.0], 0.0) == hangs.STRAGGLER_WINDOW_S


@pytest.mark.parametrize(
    ("slow_compute", "steps_per_beat", "found_after_beats", "slow_steps"),
    [
        # 1.45x its peers (barely past the weak factor 1.4): 27 steps of evidence
        (0.145, 10, 3, 30),
        (0.2, 10, 2, 20),  # half speed: 12 steps, but two reports at least
        # a fifth of the speed on long steps: the floor of 8 steps in two windows of two
        # reports each (a window holds 3 steps at least; counted windows share no report)
        (0.5, 2, 4, 8),
        # one step a report: the old rule's 20 s window comes first (12 steps counted)
        (0.145, 1, 13, 12),
    ],
)
def test_a_straggler_is_proven_by_its_steps_the_slower_the_fewer(
    tmp_path: Path,
    slow_compute: float,
    steps_per_beat: int,
    found_after_beats: int,
    slow_steps: int,
) -> None:
    """The ranks report their timed steps' sums (2 s apart, as the agents' heartbeats): the
    weaker the evidence per step, the more steps it takes, counted, not timed."""

    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0
        timings = ((0.1, slow_compute - 0.1), (0.1, slow_compute - 0.1), (slow_compute, 0.0))
        totals = {r: (0, 0.0, 0.0) for a in agents for r in _ranks(h, a)}
        beats, found = 0, []
        while beats < 40 and not found:
            for agent, (compute, wait) in zip(agents, timings, strict=True):
                progress = []
                for r in _ranks(h, agent):
                    n, c, w = totals[r]
                    totals[r] = (
                        n + steps_per_beat,
                        c + compute * steps_per_beat,
                        w + wait * steps_per_beat,
                    )
                    progress.append(
                        m.RankProgress(
                            rank=r,
                            step=totals[r][0],
                            stalled_s=0.0,
                            at=1000.0 + h.clock.now,
                            compute_s=compute,
                            wait_s=wait,
                            p99_s=0.6,
                            timed_steps=totals[r][0],
                            compute_total_s=totals[r][1],
                            wait_total_s=totals[r][2],
                        )
                    )
                watch.heartbeat(h.job.nodes[agent].node, progress)
            for _ in range(2):  # the liveness tick's checks between two heartbeats
                watch.check()
                h.clock.now += 1.0
            beats += 1
            found = h.events("straggler_detected")
        assert found, "no straggler_detected"
        assert {e["node"] for e in found} == {"n3"}
        assert found[0]["ratio"] == round(slow_compute / 0.1, 2)
        # the first reports are the round's warm-up, the second a baseline
        assert beats - 2 == found_after_beats, (beats, found[0])
        assert found[0]["slow_steps"] == slow_steps

    run(body)


_progress = hs.builds(
    m.RankProgress,
    rank=hs.integers(0, 7),
    step=hs.integers(0, 100),
    stalled_s=hs.floats(0, 2000),
    p99_s=hs.sampled_from([0.0, 0.1, 5.0, 40.0]),
    section=hs.sampled_from(["", "", "eval", "checkpoint", "mine"]),
    section_s=hs.floats(0, 3000),
    section_bound_s=hs.sampled_from([0.0, 0.0, 3.0, 90.0]),
    stopped_s=hs.sampled_from([0.0] * 8 + [2.0, 9.0]),
)


@settings(max_examples=400, deadline=None)
@given(
    ranks=hs.lists(hs.tuples(_progress, hs.floats(0, 100)), min_size=1, max_size=6),
    timeout_s=hs.sampled_from([AUTO, AUTO, 45.0]),
    warmup_s=hs.sampled_from([600.0, 120.0]),
    ending=hs.booleans(),
)
def test_one_rank_clearly_progressing_rules_out_a_hang(
    ranks: list[tuple[m.RankProgress, float]], timeout_s: float, warmup_s: float, ending: bool
) -> None:
    # the watch's shortcut (no pass over 32,768 ranks at every tick) must never hide a hang;
    # the watch takes it only while no rank is stopped (one stopped rank is a hang at once)
    now = 100.0
    seen = [(p, now - age) for p, age in ranks]
    found = hangs.hung_ranks(seen, now=now, timeout_s=timeout_s, warmup_s=warmup_s, ending=ending)
    if any(p.stopped_s > 0 for p, _ in ranks):
        return
    for p, age in ranks:
        if hangs.clearly_progressing(p, age, timeout_s=timeout_s, warmup_s=warmup_s):
            assert found is None, (p, age)


def test_round_trips_from_the_workers_start_are_no_evidence_of_a_slow_link(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="3:3")
        agents = h.start("n1", "n2", "n3")
        watch = _watch(h, tmp_path)
        watch.straggler_factor = 2.0

        def beats(seconds: float, *, p99: float, slow_rtt: float) -> list[dict]:
            end = h.clock.now + seconds
            while h.clock.now < end:
                for agent, rtt in zip(agents, (0.001, 0.0012, slow_rtt), strict=True):
                    progress = [
                        m.RankProgress(rank=r, step=1, stalled_s=0.0, p99_s=p99)
                        for r in _ranks(h, agent)
                    ]
                    watch.heartbeat(h.job.nodes[agent].node, progress, rtt_s=rtt)
                watch.check()
                h.clock.now += 1.0
            return h.events("straggler_detected")

        # n3's agent is busy starting its workers: its heartbeats come back late
        assert beats(30.0, p99=0.0, slow_rtt=0.2) == []
        # the workers are past their warm-up and n3 answers as fast as the others
        assert beats(30.0, p99=0.6, slow_rtt=0.0011) == []
        # a link that is slow in the steady state is still found
        [e] = beats(30.0, p99=0.6, slow_rtt=0.2)
        assert e["node"] == "n3" and e["cause"] == "link"

    run(body)


def test_a_computing_rank_holds_the_verdict_to_the_ceiling_a_blocked_one_does_not() -> None:
    """Issue 45: no step for the learned bound, but a rank's CPU time grows: not a hang."""
    seen = [(_p(0, 40.0, working=True), 10.0), (_p(1, 40.0), 10.0)]
    assert hangs.hung_ranks(seen, now=10.0, timeout_s=AUTO) is None
    # as if it were blocked: what the watch reports as progress_stalled
    assert hangs.hung_ranks(seen, now=10.0, timeout_s=AUTO, working_counts=False) == hangs.Bound(
        30.0, "step statistics"
    )
    ceiling = hangs.HANG_CEILING_S
    assert hangs.hung_ranks(seen, now=10.0 + ceiling, timeout_s=AUTO) == hangs.Bound(
        ceiling, "ceiling (computing)"
    )
    # a fixed --hang-timeout keeps its meaning; a stopped rank is a hang whatever the others do
    assert hangs.hung_ranks(seen, now=10.0, timeout_s=20.0) == hangs.Bound(20.0, "--hang-timeout")
    stopped = [(_p(0, 40.0, working=True), 10.0), (_p(1, 40.0, stopped_s=6.0), 10.0)]
    assert hangs.hung_ranks(stopped, now=10.0, timeout_s=AUTO).source == "stopped process"  # type: ignore[union-attr]


def _end_beat(h: Harness, watch: HangWatch, agents: list[str], **kw: object) -> None:
    """n1's ranks 0, 1 exited after step 42; n2's rank 2 exited, rank 3 is still there."""
    for agent in agents:
        progress = []
        for rank in _ranks(h, agent):
            exited = rank != 3
            p = m.RankProgress(
                rank=rank,
                step=42,
                stalled_s=kw.get("stalled", 0.0) if not exited else 0.0,  # type: ignore[arg-type]
                section="exit" if exited else str(kw.get("section", "")),
                working=bool(kw.get("working")) and not exited,
            )
            progress.append(p)
        watch.heartbeat(h.job.nodes[agent].node, progress)


def test_a_rank_blocked_after_its_peers_exited_is_ended_as_an_exit_hang(tmp_path: Path) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        watch.timeout_s = AUTO
        _end_beat(h, watch, agents, stalled=1.0)
        watch.check()  # the ending begins: nothing yet
        assert not h.events("exit_hang") and watch._task is None
        h.clock.now += hangs.EXIT_HANG_S
        _end_beat(h, watch, agents, stalled=hangs.EXIT_HANG_S + 1)
        watch.check()
        await asyncio.wait_for(watch._task, 5)  # type: ignore[arg-type]
        [hang] = h.events("exit_hang")
        assert hang["rank"] == 3 and hang["node"] == "n2" and hang["step"] == 42, hang
        assert Path(hang["stack"]).name == "rank-3.txt" and Path(hang["stack"]).exists()
        ends = [(a, msg) for a, msg in h.pushed if isinstance(msg, m.EndWorkers)]
        assert ends == [(agents[1], m.EndWorkers(ranks=[3], reason=ends[0][1].reason))]
        assert h.job.phase is Phase.RUNNING and h.job.round == 1  # no round re-forms
        assert not h.events("hang_detected") and not h.events("rendezvous_opened")
        h.clock.now += 600  # said once, however long the ending then takes
        _end_beat(h, watch, agents, stalled=700.0)
        watch.check()
        assert len(h.events("exit_hang")) == 1 and not h.events("hang_detected")

    run(body)


@pytest.mark.parametrize("kw", [{"working": True}, {"section": "checkpoint"}])
def test_a_rank_that_computes_or_saves_after_its_peers_exited_is_left_alone(
    tmp_path: Path, kw: dict
) -> None:
    async def body() -> None:
        h = Harness(tmp_path, nnodes="2:2", max_restarts=3)
        agents = h.start("n1", "n2")
        watch = _watch(h, tmp_path)
        watch.timeout_s = AUTO
        _end_beat(h, watch, agents, stalled=1.0, **kw)
        watch.check()
        h.clock.now += 400  # past the ending bound: a plain hang would have been declared
        _end_beat(h, watch, agents, stalled=401.0, **kw)
        watch.check()
        assert watch._task is None
        assert not h.events("exit_hang") and not h.events("hang_detected")

    run(body)
