"""The master's side of the pairwise network check: hand out probe tasks, collect, analyse.

The pure planning and analysis live in :mod:`dlrover_hpc.netcheck.analysis`; this executor
assigns each round's groups to agents (as ``netcheck`` assignments), gathers their reports
with a deadline (a node that does not report in time failed its group), and ends with a
:class:`CheckVerdict`.  Nodes are identified by agent id, so several agents on one host work.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from dlrover_hpc.events import EventName
from dlrover_hpc.netcheck.analysis import (
    CheckVerdict,
    GroupResult,
    RoundResult,
    analyze,
    plan_next_round,
    plan_round1,
)
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)

MAX_ROUNDS = 3


@dataclasses.dataclass(slots=True, kw_only=True)
class _Report:
    ok: bool
    check_s: float | None
    error: str


class NetcheckRun:
    def __init__(
        self,
        *,
        agents: Sequence[str],
        generation: int,
        new_store: Callable[[], int],
        store_host: str,
        timeout_s: float,
        deliver: Callable[[str, m.Assignment], None],
        on_round: Callable[[int, CheckVerdict, bool], None] = lambda _i, _v, _final: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.agents = list(agents)
        self.generation = generation
        self._new_store, self._store_host = new_store, store_host
        self._timeout_s, self._deliver, self._clock = timeout_s, deliver, clock
        self._on_round = on_round
        self.rounds: list[RoundResult] = []
        self.groups: list[tuple[str, ...]] = []
        self._reports: dict[str, _Report] = {}
        self.deadline = 0.0
        self.started = clock()
        self.verdict: CheckVerdict | None = None
        self._start_round(plan_round1(self.agents))

    @property
    def done(self) -> bool:
        return self.verdict is not None

    def _start_round(self, groups: list[tuple[str, ...]]) -> None:
        self.groups, self._reports = groups, {}
        index = len(self.rounds) + 1
        port = self._new_store()
        self.deadline = self._clock() + self._timeout_s + 5.0  # the probe's own kill + slack
        log.info("network check round=%d groups=%d", index, len(groups))
        for g, group in enumerate(groups):
            for rank, agent in enumerate(group):
                self._deliver(
                    agent,
                    m.Assignment(
                        status=m.NodeStatus.NETCHECK,
                        round=self.generation,
                        store_host=self._store_host,
                        store_port=port,
                        check_round=index,
                        group_rank=rank,
                        group_size=len(group),
                        check_prefix=f"netcheck/g{self.generation}/r{index}/grp{g}",
                        check_timeout_s=self._timeout_s,
                    ),
                )

    def report(self, agent: str, msg: m.NetcheckReport) -> None:
        if msg.check_round != len(self.rounds) + 1 or self.done:
            return  # late report of an earlier round
        self._reports[agent] = _Report(ok=msg.ok, check_s=msg.check_s, error=msg.error)

    def step(self) -> None:
        """Close the round when every member reported or the deadline passed."""
        if self.done:
            return
        members = {a for g in self.groups for a in g}
        if not (members <= set(self._reports) or self._clock() >= self.deadline):
            return
        results = []
        for group in self.groups:
            reports = [self._reports.get(a) for a in group]
            ok = all(r is not None and r.ok for r in reports)
            elapsed = {
                a: r.check_s
                for a, r in zip(group, reports, strict=True)
                if r is not None and r.ok and r.check_s is not None
            }
            error = "; ".join(
                f"{a}: {'no report in time' if r is None else r.error}"
                for a, r in zip(group, reports, strict=True)
                if r is None or not r.ok
            )
            results.append(GroupResult(nodes=group, ok=ok, elapsed_s=elapsed, error=error))
        self.rounds.append(RoundResult(round_index=len(self.rounds) + 1, groups=tuple(results)))
        verdict = analyze(self.rounds, max_rounds=MAX_ROUNDS)
        following = plan_next_round(self.rounds) if verdict.needs_another_round else []
        final = not (following and len(self.rounds) < MAX_ROUNDS)
        self._on_round(len(self.rounds), verdict, final)
        if final:
            self.verdict = verdict
        else:
            self._start_round(following)


class NetcheckGate:
    """Decides when a round must be checked first, runs the check, and says who to remove.

    Enabled when any agent asks (``--network-check``); a check runs before every start and
    restart (once per round), and the agents that passed are not checked again that round.
    """

    def __init__(
        self,
        *,
        new_store: Callable[[int], int],
        store_host: str,
        timeout_s: float,
        deliver: Callable[[str, m.Assignment], None],
        emit: Callable[..., None],
        node_name: Callable[[str], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._new_store, self._store_host, self._timeout_s = new_store, store_host, timeout_s
        self._deliver, self._emit, self._name, self._clock = deliver, emit, node_name, clock
        self.enabled = False
        self.exclude_straggler = False
        self.run: NetcheckRun | None = None
        self._checked: tuple[int, frozenset[str]] = (0, frozenset())  # (round, passed agents)

    def needs_check(self, agents: Sequence[str], generation: int) -> bool:
        if not self.enabled or len(agents) < 2:
            return False
        checked_round, passed = self._checked
        return checked_round != generation or not set(agents) <= passed

    def forget(self, agent: str) -> None:
        """``agent`` was lost and came back: probe it again before it trains."""
        checked_round, passed = self._checked
        self._checked = (checked_round, passed - {agent})

    def start(self, ranked_agents: Sequence[str], generation: int) -> float:
        """Start a check of ``ranked_agents`` (pairs are neighbours); returns its deadline."""
        self.run = NetcheckRun(
            agents=ranked_agents,
            generation=generation,
            new_store=lambda: self._new_store(generation),
            store_host=self._store_host,
            timeout_s=self._timeout_s,
            deliver=self._deliver,
            on_round=self._round_done,
            clock=self._clock,
        )
        return self.run.deadline

    def report(self, agent: str, msg: m.NetcheckReport) -> None:
        if self.run is not None:
            self.run.report(agent, msg)

    def poll(self) -> dict[str, str] | None:
        """None while a check runs; when it is done, the agents to remove and why."""
        run = self.run
        assert run is not None
        run.step()
        if run.verdict is None:
            return None
        self.run = None
        verdict = run.verdict
        removed = {a: "faulty in the network check" for a in verdict.faulty}
        if self.exclude_straggler:
            for a in verdict.stragglers:
                removed.setdefault(
                    a,
                    f"straggler in the network check ({verdict.timings_s.get(a, 0):.3f} s "
                    f"vs median {verdict.median_s or 0:.3f} s)",
                )
        log.info(
            "network check done faulty=%s stragglers=%s rounds=%d",
            sorted(self._name(a) for a in verdict.faulty),
            sorted(self._name(a) for a in verdict.stragglers),
            verdict.rounds_used,
        )
        self._checked = (run.generation, frozenset(run.agents) - set(removed))
        return removed

    def _round_done(self, index: int, verdict: CheckVerdict, final: bool) -> None:
        """``netcheck_result`` after every check round: what is known so far."""
        run = self.run
        name = self._name
        self._emit(
            EventName.NETCHECK_RESULT,
            round=index,
            generation=run.generation if run else None,
            final=final,
            faulty=sorted(name(a) for a in verdict.faulty),
            stragglers=sorted(name(a) for a in verdict.stragglers),
            unresolved=sorted(name(a) for a in verdict.unresolved),
            timings={name(a): round(t, 4) for a, t in verdict.timings_s.items()},
            median_s=verdict.median_s,
            seconds=round(self._clock() - run.started, 3) if run else None,
        )
