"""Hangs, hangs at exit and runtime stragglers, seen from the master (issues 13, 25 and 45).

Agents report each worker's step, how long since it last progressed, the p99 of its recent step
times, the section it is in (:func:`dlrover_hpc.progress.section`: a checkpoint, an evaluation,
a data loader's start, or one a script marks), whether it computes, and its newest step's
compute and wait seconds, in every heartbeat.  :mod:`dlrover_hpc.master.hang_bounds` holds
each rank to a bound; :mod:`dlrover_hpc.master.slowness` finds stragglers and slow links.

When every rank of the running round is past its bound, the master asks every agent for its
workers' stacks, writes them to ``<job dir>/hangs/<UTC time>/`` (``rank-N.txt`` and
``merged.txt``), emits ``hang_detected`` (with the bound, what it came from and the step
statistics) and restarts the workers from the newest checkpoint.  The second hang blamed on one
node is a node fault: it is excluded and drained (or quarantined), and a spare or a smaller round
takes over.  Past its bound only because ranks compute: ``progress_stalled``, no restart.
Once ranks exited after the step every rank reached, the training is over: a rank left blocked
for :data:`EXIT_HANG_S` is ended and counted as succeeded (``exit_hang``), and nothing else is
judged.  ``dlrover-hpc stacks`` uses the same collection, on demand.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from dlrover_hpc.config import HANG_AUTO, HANG_CEILING_S
from dlrover_hpc.diagnosis import stacks as st
from dlrover_hpc.events import EventName
from dlrover_hpc.jobdir import hang_report_dir
from dlrover_hpc.master import decisions as d
from dlrover_hpc.master.crash_loop import HANG, Failure
from dlrover_hpc.master.hang_bounds import (
    DETECT_SLACK_S,
    ENDING_BOUND_S,
    EXIT_HANG_S,
    FLOOR_S,
    P99_FACTOR,
    P99_MARGIN_S,
    SECTION_BOUNDS_S,
    STOPPED_BOUND_S,
    WARMUP_BOUND_S,
    WARMUP_MIN_S,
    Bound,
    clearly_progressing,
    hung_ranks,
    job_p99,
    rank_bound,
    warmup_bound,
)
from dlrover_hpc.master.job import Job
from dlrover_hpc.master.link_slowness import TcpLinks
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.slowness import (
    EXACT_PEERS,
    LINK_FACTOR,
    MIN_EXTRA_S,
    MIN_LINK_EXTRA_S,
    MIN_SAMPLES,
    MIN_WINDOW_S,
    SAMPLE_WINDOW_S,
    STRAGGLER_CHECK_S,
    STRAGGLER_WINDOW_S,
    Slow,
    evidence_window,
    slow_links,
    stragglers,
)
from dlrover_hpc.master.step_slowness import StepSlowness, weak_factor
from dlrover_hpc.protocol import messages as m

#: the rules live in hang_bounds and slowness; their names stay importable from here
__all__ = [
    "DETECT_SLACK_S",
    "ENDING_BOUND_S",
    "EXACT_PEERS",
    "EXIT_HANG_S",
    "FLOOR_S",
    "LINK_FACTOR",
    "MIN_EXTRA_S",
    "MIN_LINK_EXTRA_S",
    "MIN_SAMPLES",
    "MIN_WINDOW_S",
    "P99_FACTOR",
    "P99_MARGIN_S",
    "SAMPLE_WINDOW_S",
    "SECTION_BOUNDS_S",
    "STOPPED_BOUND_S",
    "STRAGGLER_CHECK_S",
    "STRAGGLER_WINDOW_S",
    "WARMUP_BOUND_S",
    "WARMUP_MIN_S",
    "Bound",
    "HangWatch",
    "Slow",
    "clearly_progressing",
    "evidence_window",
    "hung_ranks",
    "job_p99",
    "rank_bound",
    "slow_links",
    "stragglers",
    "warmup_bound",
]

log = logging.getLogger(__name__)

COLLECT_TIMEOUT_S = 15.0

#: a straggler_detected's action when its node goes at the next checkpoint: for a spare or a
#: replacement, or the others train on without it (they are enough, and faster so)
SWAP = "swap at the next checkpoint"
LEAVE = "leave at the next checkpoint (the others are faster without it)"
#: ... for the benched straggler a round short of MIN takes back (it was this much slower)
TRADE = "swap at the next checkpoint for the benched node {node} ({ratio:.1f}x when benched)"
#: a benched straggler is taken back for a new one that is this many times slower than it was
TRADE_MARGIN = 1.5
HANGS_PER_NODE_FAULT = 2  # the second hang blamed on a node excludes it


@dataclasses.dataclass(slots=True)
class _Seen:
    progress: m.RankProgress
    node: str
    at: float  # master clock when the report arrived


class HangWatch:
    def __init__(self, job: Job, push: Callable[[str, m.Message], None], job_dir: Path) -> None:
        self.job, self._push, self.job_dir = job, push, job_dir
        self.timeout_s = job.config.hang_timeout_s  # 0: the agents' (see joined)
        self.straggler_factor = 0.0
        self.exclude_straggler = False
        self._seen: dict[int, _Seen] = {}
        self._exits: set[int] = set()  # ranks of _seen whose newest section is "exit"
        self._stopped: set[int] = set()  # ranks whose process is stopped by a signal now
        self._newest: int | None = None  # the rank reported last
        self._round = -1
        self._busy = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[set[str], list[m.RankStackRow], asyncio.Event]] = {}
        self.hangs_by_node: dict[str, int] = {}
        self._steps = StepSlowness()  # the ranks' timed steps, counted (fail-slow)
        self._tcp = TcpLinks()  # the nodes' TCP round trips (a slow link that is alive)
        self._rtts: dict[str, collections.deque[tuple[float, float]]] = {}  # node -> (at, rtt)
        #: master clock of the round's first report; 0: none yet; None: its warm-up is measured
        self._round_began: float | None = 0.0
        self._stragglers_checked = -math.inf
        self.longest_warmup_s = 0.0  # from a round's first report to every rank's p99
        #: node -> when its link was first found slow, and the ratio of each check since
        self._link_since: dict[str, tuple[float, collections.deque[float]]] = {}
        self._reported_links: set[str] = set()
        self._reported: set[int] = set()  # stragglers reported in this round
        #: rank -> the node it was swapped out of for being slow: slow again on another node,
        #: the rank's own work is slow (rank 0's logging, an uneven split), not the node
        self._swapped_ranks: dict[int, str] = {}
        self._swap: str | None = None  # a straggler's node, out at the next checkpoint
        self._swap_ratio = 0.0  # ... how much slower than its peers it was
        #: node -> how much slower than its peers it was when benched as a straggler
        self._benched_ratio: dict[str, float] = {}
        self._ending_since: float | None = None  # when ranks were first seen exited at the end
        self._exit_ended = False  # ranks hung at exit were ended in this round
        self._stall_reported = False  # progress_stalled was said in this episode
        self._swap_after = -1  # the newest step when it was found: a save after it will do
        job.on_round_opening = self.round_opening
        job.saved_steps = self.saved_steps
        job.keeps_pace = self.keeps_pace
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ reports
    def joined(self, msg: m.Join) -> None:
        """Each agent's flags: the longest fixed --hang-timeout, else ``auto`` if any says it
        (unless the master's own is set), the largest --straggler-factor, and whether any wants
        stragglers excluded."""
        if not self.job.config.hang_timeout_s:
            mine, theirs = self.timeout_s, msg.hang_timeout_s
            if theirs > 0 or mine > 0:
                self.timeout_s = max(mine, theirs)
            elif theirs == HANG_AUTO:
                self.timeout_s = HANG_AUTO
        self.straggler_factor = max(self.straggler_factor, msg.straggler_factor)
        self.exclude_straggler |= msg.exclude_straggler

    def _new_round(self) -> None:
        """Forget the ended round's progress once the job runs another one."""
        if self.job.round != self._round:
            self._seen.clear()
            self._exits.clear()
            self._stopped.clear()
            self._newest = None
            self._steps.clear()
            self._tcp.clear()
            self._reported.clear()
            self._rtts.clear()
            self._link_since.clear()
            self._reported_links.clear()
            self._round = self.job.round
            self._round_began = 0.0
            self._ending_since, self._exit_ended = None, False
            self._stall_reported = False

    def heartbeat(
        self,
        rec_node: str,
        progress: Sequence[m.RankProgress],
        *,
        rtt_s: float = 0.0,
        tcp_rtt_s: tuple[float, float, int] = (0.0, 0.0, 0),
    ) -> None:
        self._new_round()
        now = self.job.clock()
        if self._round_began == 0.0:
            self._round_began = now
        if rtt_s > 0:
            self._rtts.setdefault(rec_node, collections.deque(maxlen=16)).append((now, rtt_s))
        if tcp_rtt_s[0] > 0:  # the median, the lowest, how many (agent/tcp_links.py)
            self._tcp.sample(rec_node, now, *tcp_rtt_s)
        for p in progress:
            old = self._seen.get(p.rank)
            self._seen[p.rank] = _Seen(p, rec_node, now)
            self._newest = p.rank
            if p.stopped_s > 0:
                self._stopped.add(p.rank)
            else:
                self._stopped.discard(p.rank)
            if p.section == "exit":
                self._exits.add(p.rank)
            elif self._exits:
                self._exits.discard(p.rank)
            new_step = p.compute_s > 0 and (old is None or old.progress.at != p.at)
            self._steps.report(
                p.rank,
                now,
                totals=(p.timed_steps, p.compute_total_s, p.wait_total_s),
                step=(p.compute_s, p.wait_s) if new_step else None,
            )

    def stacks_dumped(self, msg: m.StacksDumped) -> m.Ack:
        waiting = self._waiting.get(msg.request_id)
        if waiting is not None:
            agents, rows, done = waiting
            agents.discard(msg.agent_id)
            rows.extend(msg.ranks)
            if not agents:
                done.set()
        return m.Ack()

    # ------------------------------------------------------------------ the check
    def check(self) -> None:
        """On the master's liveness tick."""
        job = self.job
        if job.phase is not Phase.RUNNING or self._busy:
            return
        # Heartbeats of the ended round's workers can still come while the next one forms (a
        # stopped rank among them); once it runs, what they said is not about its workers.
        self._new_round()
        now = job.clock()
        world = sum(n.nproc for n in job.participants())
        complete = len(self._seen) >= world > 0
        ready = self.timeout_s and complete
        if (
            complete
            and self._round_began
            and all(s.progress.p99_s > 0 for s in self._seen.values())
        ):
            self.longest_warmup_s = max(self.longest_warmup_s, now - self._round_began)
            self._round_began = None  # measured once per round
            # Fail-slow evidence starts now: while the workers start, an agent busy spawning
            # them answers its heartbeats late, and the first steps are uneven (a CI run saw
            # a "slow link" 3 s after its workers started, from round trips of their start).
            self._steps.clear()
            self._tcp.clear()
            self._rtts.clear()
            self._link_since.clear()
        if complete and self._exit_phase(now):
            return  # the training is over: no hang, no straggler, no swap
        warmup_s = warmup_bound(self.longest_warmup_s)
        bound = None
        if ready and not self._progressing(now, warmup_s):
            judge = functools.partial(
                hung_ranks,
                [(s.progress, s.at) for s in self._seen.values()],
                now=now,
                timeout_s=self.timeout_s,
                warmup_s=warmup_s,
                ending=any(n.state is NodeState.DONE for n in job.participants()),
            )
            bound = judge()
            if bound is None and not self._stall_reported:
                blocked = judge(working_counts=False)  # a verdict but for the computing ranks
                if blocked is not None:
                    self._report_stall(blocked)
        else:
            self._stall_reported = False
        if bound is not None:
            self._busy = True
            self._task = asyncio.get_running_loop().create_task(self._hang(bound))
            return
        warmed = self._round_began is None
        # every half heartbeat (0.5 s up to 512 nodes), at most every STRAGGLER_CHECK_S: a check
        # is a pass over every rank (32,768 at 4,096 nodes), and finds news only after them
        every_s = min(STRAGGLER_CHECK_S, max(0.5, job.config.heartbeat_every_s / 2))
        if self.straggler_factor and warmed and now - self._stragglers_checked >= every_s:
            self._stragglers_checked = now
            self._check_stragglers(now)
        self._swap_if_saved()

    def _report_stall(self, bound: Bound) -> None:
        """No step for the bound, but ranks compute: said once, nothing restarted."""
        self._stall_reported = True
        working = sorted(r for r, s in self._seen.items() if s.progress.working)
        last = {r: s.progress.step for r, s in sorted(self._seen.items())}
        log.warning(
            "no step for %g s (%s) but ranks=%s compute: not a hang; restarted only past the "
            "ceiling of %g s",
            bound.seconds,
            bound.source,
            working,
            HANG_CEILING_S,
        )
        self.job.emit(
            EventName.PROGRESS_STALLED,
            working_ranks=working,
            last_step=last,
            bound_s=round(bound.seconds, 3),
            bound_from=bound.source,
            ceiling_s=HANG_CEILING_S,
        )

    def _exit_phase(self, now: float) -> bool:
        """Whether the training is over: some ranks exited (their node is done, or their
        process ended) and every other rank reached their step.  Ends (once) the ranks left
        that hang at exit (:data:`EXIT_HANG_S`)."""
        done = {n.node for n in self.job.participants() if n.state is NodeState.DONE}
        if not done and not self._exits:
            return False  # no pass over every rank (32,768 at 4,096 nodes) twice a second
        exited = {
            r: s for r, s in self._seen.items() if s.node in done or s.progress.section == "exit"
        }
        if not exited:
            return False
        last = max(s.progress.step for s in exited.values())
        left = {r: s for r, s in self._seen.items() if r not in exited}
        if any(s.progress.step < last for s in left.values()):
            return False  # a rank is behind the ones that exited: a hang, not an ending
        if self._ending_since is None:
            self._ending_since = now
            log.info("training over: ranks=%s exited at step=%d", sorted(exited), last)
        if not left or self._exit_ended or not self.timeout_s:
            return True
        ending_s = now - self._ending_since
        hung = {}
        for rank, s in left.items():
            p = s.progress
            busy = p.working or (p.section not in ("", "exit") and not p.stopped_s)
            bound = HANG_CEILING_S if busy else EXIT_HANG_S
            idle_s = p.stalled_s + (now - s.at)
            if idle_s >= bound and ending_s >= min(bound, EXIT_HANG_S):
                hung[rank] = s
        if hung:
            self._exit_ended = self._busy = True
            task = self._exit_hang(hung, last=last, waited_s=ending_s)
            self._task = asyncio.get_running_loop().create_task(task)
        return True

    async def _exit_hang(self, hung: dict[int, _Seen], *, last: int, waited_s: float) -> None:
        """Dump every stack, say ``exit_hang`` for each hung rank and have its agent end it."""
        job = self.job
        try:
            directory = hang_report_dir(self.job_dir, _stamp())
            title = (
                f"exit hang: ranks {sorted(hung)} still running {waited_s:.0f} s after their "
                f"peers exited at step {last} (round {job.round})"
            )
            ranks, _ = await self.collect(directory, title)
            stacks = {r.rank: r.stack for r in ranks}
            for rank, s in sorted(hung.items()):
                frame = st.where(stacks.get(rank))
                job.emit(
                    EventName.EXIT_HANG,
                    rank=rank,
                    node=s.node,
                    step=s.progress.step,
                    waited_s=round(waited_s, 3),
                    frame=frame,
                    stack=str(directory / f"rank-{rank}.txt"),
                    directory=str(directory),
                )
                log.error(
                    "exit hang rank=%d node=%s at %s: ending it, counted as succeeded stacks=%s",
                    rank,
                    s.node,
                    frame,
                    directory,
                )
            reason = f"hang at exit: still running {waited_s:.0f} s after peers exited"
            for agent_id, rec in list(job.nodes.items()):
                mine = sorted(r for r, s in hung.items() if s.node == rec.node)
                if mine:
                    self._push(agent_id, m.EndWorkers(ranks=mine, reason=reason))
        finally:
            self._busy = False

    def _progressing(self, now: float, warmup_s: float) -> bool:
        """No hang can be found now, seen from one rank (the newest to report) and no pass
        over all of them (32,768 ranks at every tick: the master's busiest work at scale):
        no rank is stopped by a signal, and that rank is within the shortest bound it could be
        held to, which :func:`hung_ranks` needs every rank to be past."""
        if self._stopped or self._newest is None:
            return False
        seen = self._seen.get(self._newest)
        if seen is None:
            return False
        return clearly_progressing(
            seen.progress, now - seen.at, timeout_s=self.timeout_s, warmup_s=warmup_s
        )

    def _check_stragglers(self, now: float) -> None:
        timings, slow, proven = self._steps.check(now, self.straggler_factor)
        for rank in proven:
            if rank in self._reported:
                continue
            found, episode = slow[rank], self._steps.episodes[rank]
            since = episode.since
            self._reported.add(rank)
            seen = self._seen.get(rank)
            if seen is None:
                continue
            node = seen.node
            log.warning(
                "straggler node=%s rank=%d ratio=%.2f compute=%.3fs peers=%.3fs waited=%.3fs",
                node,
                rank,
                found.ratio,
                found.compute_s,
                found.peers_compute_s,
                found.peers_wait_s,
            )
            evidence = {
                str(r): {"compute_s": round(c, 4), "wait_s": round(w, 4)}
                for r, (c, w) in sorted(timings.items())[:64]
            }
            again = self._swapped_ranks.get(rank, node) != node
            swap = "" if again else self._swap_wanted(found.ratio)
            if swap:
                self._swapped_ranks[rank] = node
            self.job.emit(
                EventName.STRAGGLER_DETECTED,
                node=node,
                rank=rank,
                cause="compute",
                ratio=found.ratio,
                compute_s=round(found.compute_s, 4),
                peers_compute_s=round(found.peers_compute_s, 4),
                peers_wait_s=round(found.peers_wait_s, 4),
                slow_for_s=round(now - since, 1),
                slow_steps=episode.steps,
                evidence=evidence,
                action=swap
                or ("reported (slow on its previous node too)" if again else "reported"),
            )
            if swap:
                self._plan_swap(node, found.ratio)
        self._check_links(now)

    def _swap_wanted(self, slowdown: float) -> str:
        """How a straggler's node (``slowdown`` times its peers' step) goes at the next
        checkpoint, if it goes ("": reported only): swapped when a spare waits to take its
        place, or the others are enough and Slurm may give a replacement (or the user asked
        for --exclude-straggler); left out, the others training on alone, when they are enough
        and faster without it (:func:`decisions.shrink_wins`); traded for the benched
        straggler a round short of MIN takes back, when it is :data:`TRADE_MARGIN` times slower
        than that one was (:meth:`_taken_back`); and no other swap is pending."""
        if self._swap is not None:
            return ""
        if self.exclude_straggler or self.job.can_swap_out():
            return SWAP
        running = self.job.phase is Phase.RUNNING
        nodes = len(self.job.participants())
        if running and d.shrink_wins(nodes, slowdown, min_nodes=self.job.config.nnodes.min):
            return LEAVE
        back = self._taken_back() if running else None
        if back is not None and self._benched_ratio[back] * TRADE_MARGIN <= slowdown:
            return TRADE.format(node=back, ratio=self._benched_ratio[back])
        return ""

    def _taken_back(self) -> str | None:
        """The benched straggler's node that a round short of MIN takes back first (the
        job's ``_reserve``: benched longest), if it waits there; None: none does.  With no
        spare and at MIN, a straggler much slower than that one was is traded for it: the
        job runs at its slowest node's pace, and the benched one has had time to recover
        (soak seed 1: a link at 1/100 of its peers' rate crawled 2 minutes at MIN 3, a node
        benched 3.6x slow 100 s before waiting idle)."""
        benched = [
            n
            for n in self.job.nodes.values()
            if n.state is NodeState.BENCHED
            and not n.drained
            and n.disconnected_at is None
            and n.waiter is not None
            and not n.waiter.done()
        ]
        if not benched:
            return None
        first = min(benched, key=lambda n: (n.joined_at, n.agent_id))
        return first.node if first.node in self._benched_ratio else None

    def _check_links(self, now: float) -> None:
        rtts = {}
        for node, samples in self._rtts.items():
            recent = [r for at, r in samples if now - at <= SAMPLE_WINDOW_S]
            if len(recent) >= MIN_SAMPLES:
                rtts[node] = statistics.median(recent)
        slow = slow_links(rtts)
        for node in list(self._link_since):
            if node not in slow:
                del self._link_since[node]
        for node, found in slow.items():
            since, ratios = self._link_since.setdefault(node, (now, collections.deque(maxlen=64)))
            ratios.append(found.ratio)
            if now - since < evidence_window(ratios, LINK_FACTOR):
                continue
            evidence = {n: {"rtt_s": round(r, 4)} for n, r in sorted(rtts.items())[:64]}
            self._slow_link(node, found, round(now - since, 1), evidence, "heartbeat")
        # The kernel's round trips of the nodes' TCP connections: strong at the first readings
        tcp, slow = self._tcp.check(now, self.job.config.heartbeat_every_s)
        for node, found in slow.items():
            evidence = {
                n: {"tcp_rtt_s": round(r, 4), "tcp_min_rtt_s": round(low, 4)}
                for n, (r, low) in sorted(tcp.items())[:64]
            }
            since = self._tcp.samples[node][0][0]  # the oldest of the readings it rests on
            self._slow_link(node, found, round(now - since, 1), evidence, "tcp")

    def _slow_link(
        self, node: str, found: Slow, slow_for_s: float, evidence: dict, measured: str
    ) -> None:
        """Says (once per node and round) that the node's link is slow; swaps it when a
        straggler's node may go."""
        if node in self._reported_links:
            return
        self._reported_links.add(node)
        ranks = sorted(r for r, s in self._seen.items() if s.node == node)
        log.warning(
            "slow link node=%s rtt=%.4fs peers=%.4fs (%s round trips)",
            node,
            found.compute_s,
            found.peers_compute_s,
            measured,
        )
        swap = self._swap_wanted(found.ratio)
        self.job.emit(
            EventName.STRAGGLER_DETECTED,
            node=node,
            rank=ranks[0] if ranks else -1,
            cause="link",
            ratio=found.ratio,
            rtt_s=round(found.compute_s, 4),
            peers_rtt_s=round(found.peers_compute_s, 4),
            measured=measured,
            slow_for_s=slow_for_s,
            evidence=evidence,
            action=swap or "reported",
        )
        if swap:
            self._plan_swap(node, found.ratio)

    def straggler_nodes(self) -> list[str]:
        """The nodes of the stragglers reported in this round (and slow links), sorted."""
        nodes = {self._seen[r].node for r in self._reported if r in self._seen}
        return sorted(nodes | self._reported_links)

    def _plan_swap(self, node: str, ratio: float) -> None:
        self._swap, self._swap_ratio = node, ratio
        self._swap_after = max((s.progress.step for s in self._seen.values()), default=-1)
        if not any(s.progress.saved_step >= 0 for s in self._seen.values()):
            return  # no flash checkpoint: nothing to persist (it goes at the next commit)
        # Every node persists its ranks' next save (PersistStep, as --persist-every does): the
        # master hears of its commit at once and swaps the node then, rather than once each
        # node's next heartbeat said it saved: up to a heartbeat interval (2 s; 8 s at 4,096
        # nodes) more at the straggler's pace (soak seed 1: 3.0 and 3.1 s after the verdict).
        notice = m.PersistStep(
            step=self._swap_after + 1, reason=f"the straggler's node {node} goes at its commit"
        )
        for agent in self.job.active_agents():
            self._push(agent, notice)

    def committed(self) -> None:
        """A checkpoint was committed: the time to swap a straggler's node for a spare."""
        if self._swap is not None and self.job.phase is Phase.RUNNING:
            self._swap_now("a checkpoint committed")

    def saved_steps(self) -> tuple[int, int] | None:
        """(The oldest of the ranks' newest steps saved to memory, the newest step any rank
        reported) in the running round; None until every rank has reported."""
        self._new_round()
        world = sum(n.nproc for n in self.job.participants())
        if not len(self._seen) >= world > 0:
            return None
        seen = self._seen.values()
        return min(s.progress.saved_step for s in seen), max(s.progress.step for s in seen)

    def keeps_pace(self, node: str) -> bool:
        """Whether ``node``'s ranks are shown to keep their peers' pace in the running round:
        each has a window of timed steps (:func:`step_slowness.recent`), none is a candidate at
        the straggler check's weak factor or in an episode, and no slow link of it is being
        timed.  False while that is not shown (a round's first steps)."""
        if not self.straggler_factor:
            return True  # nothing judges pace (and nothing benches a node for it)
        self._new_round()
        ranks = [rank for rank, seen in self._seen.items() if seen.node == node]
        if not ranks or node in self._link_since:
            return False
        windows = self._steps.windows(self.job.clock())
        if any(rank not in windows or rank in self._steps.episodes for rank in ranks):
            return False
        timings = {r: (w.compute_s, w.wait_s) for r, w in windows.items()}
        slow = stragglers(timings, weak_factor(self.straggler_factor))
        return not any(rank in slow for rank in ranks)

    def _swap_if_saved(self) -> None:
        """Every rank of the running round holds a step in memory that it saved after the
        straggler was found: the restart loses nothing, so its node goes now rather than at
        the next commit (which, on a slow node, may be many slow steps away)."""
        if self._swap is None:
            return  # no pass over every rank's record (32,768 at 4,096 nodes) twice a second
        steps = self.saved_steps()
        if steps is not None and steps[0] > self._swap_after:
            self._swap_now(f"every rank saved step {steps[0]} or later to memory")

    def _swap_now(self, why: str) -> None:
        node, self._swap = self._swap, None
        if node is None:
            return
        log.warning("swapping out the straggler's node node=%s: %s", node, why)
        self._benched_ratio[node] = self._swap_ratio
        self.job.apply([d.Bench(node, "runtime straggler")])

    def round_opening(self) -> None:
        """A round re-forms for another reason while a straggler's swap waits: the restart is
        there anyway, so its node is left out of the next round now, if the others are
        enough (a commit that came meanwhile must not drop the swap either)."""
        node = self._swap
        if node is None:
            return
        others = [
            n
            for n in self.job.nodes.values()
            if n.node != node and n.state in (NodeState.ACTIVE, NodeState.WAITING)
        ]
        if len(others) >= self.job.config.nnodes.min:
            self._swap = None
            log.warning("straggler's node left out of the next round node=%s", node)
            self._benched_ratio[node] = self._swap_ratio
            self.job.bench(node, "runtime straggler")

    # ------------------------------------------------------------------ stacks
    async def collect(self, directory: Path, title: str) -> tuple[list[st.RankStack], str]:
        """Every worker's stack, written to ``directory``; returns them and the merged view."""
        agents = {n.agent_id for n in self.job.nodes.values() if n.state is NodeState.ACTIVE}
        request_id = next(self._ids)
        done = asyncio.Event()
        rows: list[m.RankStackRow] = []
        self._waiting[request_id] = (set(agents), rows, done)
        for agent in agents:
            self._push(agent, m.DumpStacks(request_id=request_id))
        try:
            if agents:
                async with asyncio.timeout(COLLECT_TIMEOUT_S):
                    await done.wait()
        except TimeoutError:
            log.warning("stacks missing from agents=%s", sorted(self._waiting[request_id][0]))
        finally:
            del self._waiting[request_id]
        ranks = [
            st.RankStack(
                r.rank, r.node, r.pid, r.status, st.from_json(r.stack), step=r.step, error=r.error
            )
            for r in rows
        ]
        merged = st.render(ranks, title=title)
        await asyncio.to_thread(_write, directory, ranks, merged)
        return ranks, merged

    async def stacks_request(self, _msg: m.StacksRequest) -> m.StacksReply:
        """``dlrover-hpc stacks``: every worker's stack now, kept under ``stacks/``."""
        directory = self.job_dir / "stacks" / _stamp()
        title = f"job {self.job.config.job_id}, round {self.job.round}, {self.job.phase}"
        _, merged = await self.collect(directory, title)
        return m.StacksReply(directory=str(directory), text=merged)

    async def _hang(self, bound: Bound) -> None:
        job = self.job
        try:
            directory = hang_report_dir(self.job_dir, _stamp())
            last = {r: s.progress.step for r, s in sorted(self._seen.items())}
            p99 = job_p99([s.progress for s in self._seen.values()])
            sections = {
                r: s.progress.section for r, s in sorted(self._seen.items()) if s.progress.section
            }
            title = (
                f"hang: no rank progressed for {bound.seconds:g} s ({bound.source}; "
                f"round {job.round})"
            )
            ranks, _ = await self.collect(directory, title)
            found = st.suspect(ranks)
            suspect_rank, why = found if found else (-1, "no rank stands out")
            node = next((r.node for r in ranks if r.rank == suspect_rank), "")
            groups = st.merge(ranks)
            job.emit(
                EventName.HANG_DETECTED,
                ranks=sorted(last),
                last_step=last,
                frame=groups[0].where if groups else "",
                suspected_rank=suspect_rank,
                suspected_node=node,
                why=why,
                directory=str(directory),
                bound_s=round(bound.seconds, 3),
                bound_from=bound.source,
                step_p99_s=round(p99, 4),
                sections=sections,
            )
            log.error("hang detected suspect=%d (%s) stacks=%s", suspect_rank, why, directory)
            if job.phase is not Phase.RUNNING or job.round != self._round:
                return  # the round ended meanwhile (a worker failed after all)
            if node:
                self.hangs_by_node[node] = self.hangs_by_node.get(node, 0) + 1
            job.loops.tally.failed(
                Failure(
                    round=job.round,
                    node=node,
                    rank=suspect_rank,
                    classification=HANG,
                    error=f"{title}; suspect rank {suspect_rank}: {why}",
                )
            )
            records = list(job.nodes.values())
            faulty = node and self.hangs_by_node[node] >= HANGS_PER_NODE_FAULT
            if faulty and d.can_leave(node, records, min_nodes=job.params.min_nodes):
                reason = f"{self.hangs_by_node[node]} hangs blamed on it ({why})"
                job.apply([d.Exclude(node, reason), d.RemoveNode(node, reason)])
            else:
                if faulty:  # without it the job would stop, waiting for nodes: it restarts
                    log.warning(
                        "node kept node=%s hangs=%d: without it fewer than MIN %d nodes",
                        node,
                        self.hangs_by_node[node],
                        job.params.min_nodes,
                    )
                reason = f"hang: no progress for {bound.seconds:g} s ({bound.source})"
                job.apply(
                    d.charge(
                        restart_count=job.restart_count,
                        max_restarts=job.config.max_restarts,
                        reason=reason,
                        loop=job.loop_now(),
                    )
                )
        finally:
            self._seen.clear()
            self._exits.clear()
            self._steps.clear()
            self._tcp.clear()
            self._busy = False


def _stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _write(directory: Path, ranks: Sequence[st.RankStack], merged: str) -> None:
    """``merged.txt`` first (what a reader wants), then each rank's file: plain os writes, a
    fifth of Path.write_text's time (32,768 ranks: ~0.9 s here, not ~4 s)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "merged.txt").write_text(merged)
    for r in ranks:
        fd = os.open(directory / f"rank-{r.rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, st.rank_text(r).encode())
        finally:
            os.close(fd)
