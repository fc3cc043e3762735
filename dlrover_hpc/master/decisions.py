"""What the master does about an event: pure functions from the node table to actions.

Each function takes the facts it needs (the phase, the round, the node records, the clock's
reading) and returns :data:`Action` values; none of them changes a record, talks to an agent or
runs a Slurm command.  :class:`dlrover_hpc.master.job.Job` performs the actions in order.  The
tests in ``tests/master/test_decisions.py`` call these directly, one row per case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from dlrover_hpc.config import DrainMode
from dlrover_hpc.master.nodes import NodeRecord, NodeState
from dlrover_hpc.master.phases import Phase
from dlrover_hpc.master.resume import RESUME_GRACE_S
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.rendezvous.state import Decision, DecisionKind, RdzvParams, usable_count

HARDWARE = "hardware"  # the agent's classification of a worker failure that drains its node
PEER = "peer"  # ... of one that only lost a peer: a symptom, charged only if no node was lost
#: How long a peer-lost failure waits for the membership change that would explain it: the
#: disconnect grace plus the keepalive detection of a cut link, with margin.
PEER_GRACE_S = 10.0


# ------------------------------------------------------------------------- actions
@dataclasses.dataclass(frozen=True, slots=True)
class OpenRound:
    """Give up the running round: active agents stop their workers and re-join."""

    phase: Phase  # one of phases.REOPEN
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Finish:
    exit_code: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class CrashLoop:
    """Rounds in a row failed without progress (:mod:`dlrover_hpc.master.crash_loop`): the
    ``crash_loop`` event, and the failure ``job_finished`` names; a :class:`Finish` follows."""

    rounds: int
    failure: dict[str, object]  # the repeated one: round, node, rank, classification, error
    failures: list[dict[str, object]]  # each round's, oldest first


@dataclasses.dataclass(frozen=True, slots=True)
class CountRestart:
    """Charge one restart to ``--max-restarts`` (journaled)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChargeLater:
    """Charge one restart after :data:`PEER_GRACE_S` unless a node is lost or excluded first."""

    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Exclude:
    """Never admit ``node`` again in this job (journaled)."""

    node: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class Bench:
    """Take a straggler's ``node`` out of the rounds; it is taken back only when a round would
    otherwise wait below MIN (see `Job.bench`)."""

    node: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class RemoveNode:
    """Take ``node`` out of the cluster: ``scontrol`` drain, or quarantine."""

    node: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class MarkLost:
    agent_id: str
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestReplacement:
    count: int
    avoid: tuple[str, ...]  # nodes the replacement must not land on


@dataclasses.dataclass(frozen=True, slots=True)
class Relaunch:
    """Start a new agent on ``node``, still ours in Slurm, whose agent died."""

    node: str
    agent_id: str  # the lost agent: its command line and node index are reused
    attempt: int


@dataclasses.dataclass(frozen=True, slots=True)
class Requeue:
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class EnterPhase:
    phase: Phase


@dataclasses.dataclass(frozen=True, slots=True)
class StartNetcheck:
    agents: tuple[str, ...]  # the chosen agents


@dataclasses.dataclass(frozen=True, slots=True)
class CompleteRound:
    agents: tuple[str, ...]  # the chosen agents


@dataclasses.dataclass(frozen=True, slots=True)
class WakeAt:
    """Run the rendezvous decision again at this monotonic time."""

    at: float | None


Action = (
    OpenRound
    | Finish
    | CrashLoop
    | CountRestart
    | ChargeLater
    | Exclude
    | Bench
    | RemoveNode
    | MarkLost
    | RequestReplacement
    | Relaunch
    | Requeue
    | EnterPhase
    | StartNetcheck
    | CompleteRound
    | WakeAt
)

#: Node states that still count towards the job's capacity.
USABLE = frozenset({NodeState.WAITING, NodeState.ACTIVE, NodeState.DONE})
#: ... and towards a forming round: the rendezvous may still hear from these.
ALIVE = frozenset({NodeState.WAITING, NodeState.ACTIVE})
#: An agent in these states runs on its node (a benched straggler's waits there).
HOSTING = USABLE | {NodeState.BENCHED}


def reachable(rec: NodeRecord) -> bool:
    """The rendezvous may still hear from it: alive and connected (an agent whose connection
    dropped is not waited for; when it reconnects, it re-joins)."""
    return rec.state in ALIVE and rec.disconnected_at is None


# ----------------------------------------------------------------------- decisions
def worker_failed(
    msg: m.WorkerFailed,
    *,
    node: str,
    node_active: bool,
    phase: Phase,
    round: int,
    restart_count: int,
    max_restarts: int,
    drain: DrainMode,
    loop: Sequence[Action] = (),
) -> list[Action]:
    """A worker failed on ``node`` (``node_active``: one of its agents is in the round).

    A hardware fault excludes the node even when a peer's failure already opened the next
    round (a dying rank often takes its peers down first).  The running round is charged
    once: a report of an older round, or one whose node's exclusion already re-forms the
    round (a membership change), spends no restart.  A worker that only lost a peer
    (``peer``) restarts at once; its restart is charged after :data:`PEER_GRACE_S` unless a
    node is lost or excluded meanwhile (then the failure was the membership change's).
    ``loop``: the crash-loop guard's word on the round failing now (see :func:`charge`).
    """
    actions: list[Action] = []
    hardware = msg.classification == HARDWARE and drain is not DrainMode.OFF
    if hardware:
        reason = f"hardware fault on rank {msg.rank}: {msg.reason[:120]}"
        actions += [Exclude(node, reason), RemoveNode(node, reason)]
    if msg.round != round or phase is not Phase.RUNNING or (hardware and node_active):
        return actions
    reason = f"worker {msg.rank} on {node} failed"
    if msg.classification == PEER:  # restart now; whether it costs a restart is known later
        return [*actions, OpenRound(Phase.RESTARTING, reason), ChargeLater(reason)]
    return [
        *actions,
        *charge(restart_count=restart_count, max_restarts=max_restarts, reason=reason, loop=loop),
    ]


def node_unhealthy(node: str, check: str, reason: str, *, drain: DrainMode) -> list[Action]:
    """``node`` failed its health check before joining (:mod:`dlrover_hpc.agent.health`): it
    never trains in this job, even with ``--drain=off`` (which only keeps Slurm's state as it
    is), and is drained or quarantined as for a hardware fault, so a replacement is asked for."""
    why = f"unhealthy ({check}): {reason[:200]}"
    return [Exclude(node, why), *([RemoveNode(node, why)] if drain is not DrainMode.OFF else [])]


def charge(
    *, restart_count: int, max_restarts: int, reason: str = "", loop: Sequence[Action] = ()
) -> list[Action]:
    """One restart of the workers' own making: spend it, or fail when none is left.

    With ``reason`` the round is re-formed as well (a fresh failure); without, it already was
    (a peer-lost failure whose grace ran out with no membership change to explain it).
    ``loop``: what the crash-loop guard says of the round failing now (a CrashLoop and its
    Finish, or nothing): when no restart is left, the job ends as a crash loop if it is one."""
    if restart_count + 1 > max_restarts:
        used = f"worker failed and the job's {max_restarts} restarts are used up"
        return [CountRestart(), *(loop or [Finish(1, used)])]
    return [CountRestart(), *([OpenRound(Phase.RESTARTING, reason)] if reason else [])]


def workers_succeeded(phase: Phase, participants: Sequence[NodeRecord]) -> list[Action]:
    """A node's workers all exited 0; the job is done when every node of the round is, and
    it failed (exit 1) if the newest step it was asked to persist is not on storage: the next
    run would silently start from an older step."""
    if phase is Phase.RUNNING and all(n.state is NodeState.DONE for n in participants):
        for ckpt_dir, (wanted, durable, error) in sorted(durability(participants).items()):
            if durable < wanted:
                newest = f"step {durable}" if durable >= 0 else "none"
                return [
                    Finish(
                        1,
                        f"all workers succeeded, but checkpoint step {wanted} is not on "
                        f"storage: the newest committed in {ckpt_dir} is {newest} "
                        f"({error or 'its persist did not finish'}); a new run resumes from it",
                    )
                ]
        return [Finish(0, "all workers succeeded")]
    return []


def durability(nodes: Sequence[NodeRecord]) -> dict[str, tuple[int, int, str]]:
    """Per checkpoint directory: (the newest step any node was asked to persist, the newest
    committed step any node read on storage, a persist failure).  Each node reads storage after
    its own last persist; the node that completes the newest commit reads it after writing it,
    so the largest reading is the one to trust."""
    out: dict[str, tuple[int, int, str]] = {}
    for n in nodes:
        for c in n.checkpoints:
            wanted, durable, error = out.get(c.ckpt_dir, (-1, -1, ""))
            out[c.ckpt_dir] = (max(wanted, c.wanted), max(durable, c.durable), error or c.error)
    return out


def excluded(
    phase: Phase, node: str, reason: str, was_active: bool, *, how: str = "excluded"
) -> list[Action]:
    """``node`` was excluded (or benched); ``was_active``: one of its agents was in the
    running round."""
    if was_active and phase is Phase.RUNNING:
        return [OpenRound(Phase.SHRINKING, f"node {node} {how}: {reason}")]
    return []


def node_lost(phase: Phase, round: int, rec: NodeRecord, reason: str) -> list[Action]:
    """``rec`` (still in its old state) stopped heart-beating or disconnected."""
    if rec.state is NodeState.ACTIVE and rec.round == round and phase is Phase.RUNNING:
        return [OpenRound(Phase.SHRINKING, f"node {rec.node} lost ({reason})")]
    return []


def lost_agents(
    records: Iterable[NodeRecord],
    *,
    now: float,
    heartbeat_timeout_s: float,
    forming: bool = False,
) -> list[Action]:
    """Agents silent for longer than the heartbeat timeout, or disconnected for a grace (a
    closed connection may be an agent about to reconnect, its workers training on); a link
    that timed out was already silent for the link timeout, so it gets no grace.

    ``forming``: a round forms (:data:`phases.FORMING`).  The grace keeps a node's place in a
    running round; while one forms, a node that is not connected only holds it up, and at MIN
    the relaunch that would bring its node back waits for the loss (soak seed 3: a killed
    agent's 3 s grace was 3 of a 6.9 s stall).  So a closed connection is lost then at once;
    an agent that does reconnect is taken back as a spare (``node_readmitted``), and a
    relaunch that finds it alive stops at the node lock."""
    grace = 0.0 if forming else min(heartbeat_timeout_s, 3.0)
    actions: list[Action] = []
    for rec in records:
        if rec.state in (NodeState.LOST, NodeState.EXCLUDED, NodeState.DONE):
            continue
        silent = now - rec.last_seen > heartbeat_timeout_s
        cut = rec.disconnected_at is not None and rec.link_timed_out
        # A member restored from the journal gets longer: its agent is still reconnecting.
        wait = RESUME_GRACE_S if rec.resumed else grace
        gone = rec.disconnected_at is not None and (now - rec.disconnected_at > wait or not wait)
        if silent or cut or gone:
            why = "no heartbeat" if silent else "link timed out" if cut else "connection closed"
            if rec.resumed and not silent:
                why = "did not re-register with the restarted master"
            actions.append(MarkLost(rec.agent_id, why))
    return actions


@dataclasses.dataclass(frozen=True, slots=True)
class ScaleUpWait:
    """A scale-up put off to the next checkpoint (issue 26): a restart now would redo every
    step since the last one, and the next fault's restart may take the node in for free."""

    since: float  # master clock when the scale-up was first due
    after_step: int  # the newest step any rank had reported then: a save after it will do


def scale_up_due(
    wait: ScaleUpWait, *, saved: int | None, committed: int, now: float, limit_s: float
) -> str | None:
    """Why a put-off scale-up goes now, or None to keep waiting.  ``saved``: the oldest of
    the newest steps each rank of the round holds in memory (None: not every rank reported
    one); ``committed``: the newest step committed to storage."""
    if saved is not None and saved > wait.after_step:
        return f"every rank saved step {saved} or later to memory"
    if committed > wait.after_step:
        return f"step {committed} committed"
    if now - wait.since >= limit_s:
        return f"no checkpoint within {limit_s:g} s"
    return None


def scale_up(participants: Sequence[NodeRecord], ready: int, params: RdzvParams) -> list[Action]:
    """Running below MAX while ``ready`` new agents (replacements) wait: take them in."""
    if any(n.state is not NodeState.ACTIVE for n in participants):
        return []
    if ready and usable_count(params, len(participants) + ready) > len(participants):
        return [OpenRound(Phase.RENDEZVOUS, f"scale up: {ready} more node(s) waiting")]
    return []


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """What the capacity check remembers between calls."""

    losses: int = 0  # nodes lost or excluded so far
    replaced: int = 0  # ... for which replacements were requested
    below_min_since: float | None = None
    failures: int = 0  # replacement requests Slurm refused since capacity was last full
    retry_at: float = 0.0  # no request before this time (back-off after a refusal)
    #: the most nodes alive at once before the first loss: MAX and the hot spares the job was
    #: given (N+k), which replacements refill (0: not seen yet, the target is MAX)
    pool: int = 0
    #: The spares' own requests, once the job is back at MAX (never before: a request for
    #: more nodes than Slurm has free waits for all of them, the ones MAX needs too).
    spares_asked: int = 0  # losses for which the spares were asked for (or given up)
    spare_failures: int = 0  # their refusals since they were last asked for afresh
    spare_retry_at: float = 0.0
    asking_spares: bool = False  # the newest request was the spares' (its refusal is theirs)

    def target(self, params: RdzvParams) -> int:
        """The nodes replacements bring the job back to: MAX, and the hot spares it began
        with.  Only MAX would leave the job without a spare once one was used, and each later
        loss would cost two restarts: a shrink, then the returning node's scale-up."""
        return max(params.max_nodes, self.pool)

    def lost(self, count: int = 1) -> Capacity:
        return dataclasses.replace(self, losses=self.losses + count)


def can_leave(node: str, records: Sequence[NodeRecord], *, min_nodes: int) -> bool:
    """Whether MIN nodes are left to train without ``node``: the others that train or wait (hot
    spares, and benched stragglers, which a round short of MIN takes back).  Without them,
    taking ``node`` out (a drained node's swap, a node blamed for hangs) would stop the whole
    job, waiting for nodes: the node trains on instead until a spare or a replacement is
    there.  A node benched because Slurm drained it is not counted: no round takes it back."""
    others = (n for n in records if n.node != node and n.state in HOSTING and not n.drained)
    return sum(1 for _ in others) >= min_nodes


def shrink_wins(nodes: int, slowdown: float, *, min_nodes: int) -> bool:
    """Whether the job trains faster without a slow node than with it (pure): ``nodes`` train
    in lock-step, each step ``slowdown`` times longer for the slow one (its compute, or the
    round trips of its link, which every collective waits on), so ``nodes / slowdown`` nodes'
    worth of steps with it against ``nodes - 1`` without; and MIN are left without it.  A
    straggler with no spare and no replacement is then left out rather than only reported:
    a link at a quarter of its peers' rate made soak seed 2 crawl for 38 s at 4 of MIN 3."""
    left = nodes - 1
    return left >= min_nodes and slowdown > 0 and left > nodes / slowdown


#: Back-off between refused replacement requests: 5, 10, 20, 40, 60, 60 ... seconds.
RETRY_FIRST_S, RETRY_MAX_S = 5.0, 60.0


#: Requests for the hot spares beyond MAX before the job goes on without them (each refusal
#: asks again at the same count: 5, 10, then 20 s later).  Slurm refuses while every free node is
#: still the job's own (a node behind a cut link, until Slurm takes it back): soak seed 1's
#: refill was refused 1 s after such a loss, and the drain 55 s later found no spare.
SPARE_TRIES = 4


def retry_backoff(failures: int) -> float:
    """Seconds to wait after the ``failures``-th refusal in a row (5, 10, 20, 40, 60, 60 ...)."""
    return min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (failures - 1))


def replacement_count(alive: int, failures: int, params: RdzvParams) -> int:
    """Nodes to ask for: up to MAX, one fewer per refusal, never fewer than MIN needs."""
    need = max(0, params.min_nodes - alive)
    return max(need, params.max_nodes - alive - failures)


def capacity(
    cap: Capacity,
    *,
    phase: Phase,
    records: Sequence[NodeRecord],
    excluded_nodes: Iterable[str],
    params: RdzvParams,
    now: float,
    min_nodes_timeout_s: float,
    can_replace: bool,
    can_requeue: bool,
    relaunching: int = 0,
    judging: bool = False,
) -> tuple[Capacity, list[Action]]:
    """After hot spares: ask for a replacement job; below MIN for too long: requeue.

    Replacements bring the job back to MAX; then, in a request of their own, to the hot spares
    it began with (the most nodes alive at once before its first loss, :attr:`Capacity.pool`):
    a spare that took a lost node's place is itself replaced, so the next loss again costs one
    restart, not a shrink and a scale-up.

    A replacement avoids only the nodes that are faulty (excluded: drained, quarantined, failed
    the network check) and those this job's agents hold now; the executor adds the job's own
    allocation.  Avoiding every node ever held is what makes Slurm answer "Requested node
    configuration is not available".  The caller runs it only once its process completed a
    rendezvous: a master resumed from its journal waits for its agents, as a fresh one does.

    Agents being relaunched in the allocation (``relaunching``) count as alive: a relaunch is
    cheaper than any replacement.  While ``judging`` (a loss newer than the last look at the
    allocation, so it may yet be relaunched) no replacement is requested.
    """
    if phase in (Phase.FINISHED, Phase.FAILED):
        return cap, []
    actions: list[Action] = []
    alive = sum(1 for n in records if n.state in USABLE) + relaunching
    if cap.losses == 0 and alive > cap.pool:
        cap = dataclasses.replace(cap, pool=alive)
    if alive >= params.max_nodes and cap.failures:
        cap = dataclasses.replace(cap, failures=0, retry_at=0.0)  # full again: start afresh
    target = cap.target(params)
    if alive >= target and cap.spare_failures:
        cap = dataclasses.replace(cap, spare_failures=0, spare_retry_at=0.0)
    wanted = cap.losses > cap.replaced and alive < params.max_nodes
    count = replacement_count(alive, cap.failures, params)
    held = {n.node for n in records if n.state in HOSTING}
    avoid = tuple(sorted(held | set(excluded_nodes)))
    asking = can_replace and not judging
    # A loss is settled only by a request: while nothing is to be asked for (a relaunch in
    # flight counts as alive; after a refusal, one node fewer) it stays owed, so a relaunch
    # that fails, or a later loss, asks then.
    if wanted and count > 0 and asking and now >= cap.retry_at:
        cap = dataclasses.replace(cap, replaced=cap.losses, asking_spares=False)
        actions.append(RequestReplacement(count, avoid))
    elif (
        params.max_nodes <= alive < target
        and cap.losses > cap.spares_asked
        and asking
        and now >= cap.spare_retry_at
    ):
        cap = dataclasses.replace(cap, spares_asked=cap.losses, asking_spares=True)
        actions.append(RequestReplacement(target - alive, avoid))
    if alive >= params.min_nodes:
        return dataclasses.replace(cap, below_min_since=None), actions
    if cap.below_min_since is None:
        cap = dataclasses.replace(cap, below_min_since=now)
    if phase in (Phase.RENDEZVOUS, Phase.RESTARTING, Phase.SHRINKING):
        actions.append(EnterPhase(Phase.REPLACING))
    waited = now - (cap.below_min_since or now)
    if waited >= min_nodes_timeout_s and can_requeue:
        reason = f"fewer than {params.min_nodes} nodes for {waited:.0f} s"
        actions += [Requeue(reason), Finish(1, f"requeued: {reason}")]
    return cap, actions


def replacement_failed(
    cap: Capacity, *, alive: int, params: RdzvParams, now: float
) -> tuple[Capacity, str]:
    """Slurm refused a replacement request: back off, then ask for one node fewer, down to
    what MIN needs; at or above MIN with nothing left to ask for, go on with the nodes there
    are.  A refused request for the spares beyond MAX is asked again at the same count,
    :data:`SPARE_TRIES` times in all.  Returns the new state and the next action, for the
    ``replacement_failed`` event."""
    if cap.asking_spares:
        failures = cap.spare_failures + 1
        backoff = retry_backoff(failures)
        if failures >= SPARE_TRIES:  # until a later loss asks afresh
            cap = dataclasses.replace(cap, spare_failures=0, spares_asked=cap.losses)
            return cap, f"no retry: go on with {alive} node(s), no hot spare"
        cap = dataclasses.replace(
            cap, spare_failures=failures, spare_retry_at=now + backoff, spares_asked=0
        )
        count = max(0, cap.target(params) - alive)
        return cap, f"retry in {backoff:.0f} s for {count} hot spare(s)"
    failures = cap.failures + 1
    backoff = retry_backoff(failures)
    count = replacement_count(alive, failures, params)
    if count == 0:
        cap = dataclasses.replace(cap, failures=failures, replaced=cap.losses)
        return cap, f"no retry: go on with {alive} node(s), at least MIN {params.min_nodes}"
    cap = dataclasses.replace(
        cap, failures=failures, retry_at=now + backoff, replaced=min(cap.replaced, cap.losses - 1)
    )
    return cap, f"retry in {backoff:.0f} s for {count} node(s)"


def form_round(decision: Decision, *, params: RdzvParams, needs_netcheck: bool) -> list[Action]:
    """The rendezvous decision for an open round, as actions."""
    if decision.kind is DecisionKind.COMPLETE:
        if needs_netcheck:
            return [StartNetcheck(decision.chosen)]
        return [CompleteRound(decision.chosen)]
    if decision.kind is DecisionKind.TIMEOUT:
        return [Finish(1, f"fewer than {params.min_nodes} nodes for {params.timeout_s:.0f} s")]
    return [WakeAt(decision.wake_at)]
