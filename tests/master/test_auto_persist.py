"""``--persist-every`` on the master, driven through the real Job, its handlers and its step
log (only the clock is ours): when it asks every node for a step, and the interval it says."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dlrover_hpc.master.auto_persist import (
    ASK_AHEAD_S,
    ASK_AHEAD_SHARE,
    REQUEST_BACKSTOP_S,
    REQUEST_TIMEOUT_S,
    AutoPersist,
)
from dlrover_hpc.master.hangs import HangWatch
from dlrover_hpc.master.persist_interval import daly_interval
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.values import PERSIST_AUTO

from .test_job import Harness, run

RATE = 10.0  # steps a second


def _beat(h: Harness, hangs: HangWatch, agents: list[str], step: int) -> None:
    """Every rank at ``step`` (saved to memory too), as a heartbeat of ``RATE`` steps a second
    whose newest step is now."""
    now = time.time()
    for agent in agents:
        rec = h.job.nodes[agent]
        assert rec.assignment is not None
        progress = [
            m.RankProgress(
                rank=rec.assignment.rank_offset + lr,
                step=step,
                stalled_s=0.0,
                at=now,
                saved_step=step,
            )
            for lr in range(rec.nproc)
        ]
        hangs.heartbeat(rec.node, progress)
        h.agents.heartbeat(m.Heartbeat(agent_id=agent, round=h.job.round, progress=progress))


def _train(h: Harness, hangs: HangWatch, agents: list[str], steps: range) -> None:
    """Steps reported a heartbeat apart (the step log's rate needs a few seconds of them)."""
    for step in steps:
        _beat(h, hangs, agents, step)
        time.sleep(1 / RATE)


def _pushed(h: Harness) -> Callable[[str, m.Message], None]:
    return lambda agent, msg: h.pushed.append((agent, msg))


def _trained(tmp_path: Path, **config: Any) -> tuple[Harness, HangWatch, AutoPersist, list[str]]:
    """Two nodes of 2 ranks trained 29 steps (every rank saved each), the watch on them."""
    h = Harness(tmp_path, nnodes="2:2", **config)
    agents = h.start("n1", "n2")
    hangs = HangWatch(h.job, lambda a, msg: None, tmp_path)
    watch = AutoPersist(h.job, h.agents.steps, _pushed(h), h.job.config)
    _train(h, hangs, agents, range(1, 30))
    return h, hangs, watch, agents


def _asked(h: Harness) -> list[tuple[str, int]]:
    return [(a, msg.step) for a, msg in h.pushed if isinstance(msg, m.PersistStep)]


def _commit(h: Harness, step: int) -> None:
    h.agents.checkpoint_part(
        m.CheckpointPart(step=step, ranks=[0, 1, 2, 3], world_size=4, path=f"ckpt/{step}")
    )


def test_a_fixed_interval_asks_every_node_for_one_step_ahead(tmp_path: Path) -> None:
    async def body() -> None:
        h, _hangs, watch, agents = _trained(tmp_path, persist_every_s=10.0)
        watch.check()  # storage's newest step is as old as the training: 0 s
        [said] = h.events("persist_interval")
        assert said["interval_s"] == 10.0 and said["mode"] == "fixed"
        assert "persist_s" not in said
        h.clock.now += 10.0 - ASK_AHEAD_S - 0.1
        watch.check()
        assert _asked(h) == []  # not yet
        h.clock.now += 0.2
        watch.check()
        asked = _asked(h)
        assert sorted(a for a, _ in asked) == sorted(agents)  # every node ...
        [step] = {s for _, s in asked}  # ... the same step
        rate = h.agents.steps.step_rate()
        assert rate > 0
        # ahead of the ranks by the lead at the step rate: they reported 29 a moment ago
        # (projected to now: 29, or a step or two more on a slow machine)
        lead = max(2, math.ceil(rate * ASK_AHEAD_S))
        assert 29 + lead <= step <= 29 + lead + 3, (step, rate)
        h.clock.now += 1.0
        watch.check()
        assert len(_asked(h)) == 2  # one request in flight
        _commit(h, step)
        watch.check()  # committed: the interval starts again
        h.clock.now += 10.0 - ASK_AHEAD_S - 0.1
        watch.check()
        assert len(_asked(h)) == 2
        h.clock.now += 0.2
        watch.check()
        assert len(_asked(h)) == 4
        assert len(h.events("persist_interval")) == 1  # said once

    run(body)


def test_a_short_interval_asks_a_quarter_of_it_ahead(tmp_path: Path) -> None:
    """A 3.2 s interval is not asked 2.5 s ahead: a rate off by 2x would commit at 2 s gaps."""

    async def body() -> None:
        h, _hangs, watch, _agents = _trained(tmp_path, persist_every_s=3.2)
        watch.check()
        lead_s = ASK_AHEAD_SHARE * 3.2
        assert lead_s < ASK_AHEAD_S
        h.clock.now += 3.2 - lead_s - 0.1
        watch.check()
        assert _asked(h) == []  # 2.5 s ahead would have asked already
        h.clock.now += 0.2
        watch.check()
        [step] = {s for _, s in _asked(h)}
        lead = max(2, math.ceil(h.agents.steps.step_rate() * lead_s))
        assert 29 + lead <= step <= 29 + lead + 3, step

    run(body)


def test_a_script_whose_disk_saves_are_fresh_enough_is_never_asked(tmp_path: Path) -> None:
    async def body() -> None:
        h, _hangs, watch, _agents = _trained(tmp_path, persist_every_s=10.0)
        for step in range(10, 100, 10):  # the script's own DISK saves, every 5 s
            watch.check()
            h.clock.now += 5.0
            _commit(h, step)
        watch.check()
        assert _asked(h) == []

    run(body)


def test_auto_measures_a_persist_then_chooses_young_daly_and_follows_failures(
    tmp_path: Path,
) -> None:
    async def body() -> None:
        h, _hangs, watch, _agents = _trained(
            tmp_path, persist_every_s=PERSIST_AUTO, node_mtbf_s=400.0
        )
        watch.check()
        [(_, first), _] = _asked(h)  # no persist measured yet: one at once, to measure it
        assert not h.events("persist_interval")
        for node, seconds in (("n1", 1.5), ("n2", 2.0)):  # the slowest node's is the step's
            watch.persisted({"step": first, "persist_s": seconds, "node": node})
        _commit(h, first)
        watch.check()
        [said] = h.events("persist_interval")
        # the site's 400 s per node over 2 nodes: 200 s; sqrt(2 x 2 x 200) - 2 = 26.3 s
        assert said["mode"] == "auto" and said["mtbf_source"] == "site", said
        assert said["persist_s"] == 2.0 and said["mtbf_s"] == 200.0, said
        assert said["interval_s"] == round(daly_interval(2.0, 200.0), 3) == 26.284, said
        h.clock.now += 10.0  # 10 s of 2 nodes trained: 20 node-seconds
        watch.check()
        h.job.restart_count += 1  # a failure that cost a restart
        h.clock.now += 10.0  # 40 node-seconds, one failure: the job's MTBF is 20 s
        watch.check()
        observed = h.events("persist_interval")[-1]
        assert observed["mtbf_source"] == "observed", observed
        assert observed["mtbf_s"] == 20.0, observed
        assert observed["interval_s"] == round(daly_interval(2.0, 20.0), 3) == 6.944, observed

    run(body)


def test_a_first_persist_committed_before_its_time_is_reported_asks_no_second_step(
    tmp_path: Path,
) -> None:
    """A node sends the commit before its ``checkpoint_persisted`` event: between the two, the
    interval is still unknown, and asking another "first persist" then committed two steps a
    fraction of a second apart (CI: a 0.35 s gap, then 2.2-3.1 s at a 3.1 s interval)."""

    async def body() -> None:
        h, hangs, watch, agents = _trained(
            tmp_path, persist_every_s=PERSIST_AUTO, node_mtbf_s=400.0
        )
        watch.check()
        [(_, first), _] = _asked(h)
        _beat(h, hangs, agents, first)
        _commit(h, first)
        watch.check()  # committed, its time not here yet
        h.clock.now += REQUEST_TIMEOUT_S - 0.1
        watch.check()
        assert len(_asked(h)) == 2 and not h.events("persist_interval")
        for node in ("n1", "n2"):
            watch.persisted({"step": first, "persist_s": 0.05, "node": node})
        watch.check()
        [said] = h.events("persist_interval")
        assert len(_asked(h)) == 2  # the next one at the interval, not now
        h.clock.now += said["interval_s"] - ASK_AHEAD_SHARE * said["interval_s"] + 0.1
        watch.check()
        assert len(_asked(h)) == 4

    run(body)


def test_a_first_persist_whose_time_never_comes_is_asked_again(tmp_path: Path) -> None:
    async def body() -> None:
        h, _hangs, watch, _agents = _trained(
            tmp_path, persist_every_s=PERSIST_AUTO, node_mtbf_s=400.0
        )
        watch.check()
        [(_, first), _] = _asked(h)
        _commit(h, first)
        watch.check()
        h.clock.now += REQUEST_TIMEOUT_S + 0.1  # its node died before it said the time
        watch.check()
        assert len(_asked(h)) == 4 and not h.events("persist_interval")

    run(body)


def test_a_request_is_given_up_only_after_every_rank_saved_its_step(tmp_path: Path) -> None:
    """A loaded machine's ranks reach the step later than projected: a request given up
    before they reach it still commits, just before the later step asked in its place."""

    async def body() -> None:
        h, hangs, watch, agents = _trained(tmp_path, persist_every_s=10.0)
        watch.check()
        h.clock.now += 10.0
        watch.check()
        [step] = {s for _, s in _asked(h)}
        h.clock.now += 20.0  # the ranks are slow: still short of the step
        _beat(h, hangs, agents, step - 1)
        watch.check()
        assert len(_asked(h)) == 2
        _beat(h, hangs, agents, step)  # every rank saved it: the persist has its time now
        watch.check()
        h.clock.now += REQUEST_TIMEOUT_S - 0.1
        watch.check()
        assert len(_asked(h)) == 2
        h.clock.now += 0.2  # saved, not committed (a rank saved past it before it was asked)
        watch.check()
        asked = _asked(h)
        assert len(asked) == 4 and asked[-1][1] > step, asked
        # ranks that never reach the step (they stopped saving) are asked again in the end
        h.clock.now += REQUEST_BACKSTOP_S - 0.1
        watch.check()
        assert len(_asked(h)) == 4
        h.clock.now += 0.2
        watch.check()
        assert len(_asked(h)) == 6

    run(body)
