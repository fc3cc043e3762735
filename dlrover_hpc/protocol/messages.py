"""One dataclass per message kind on the master's wire, and the registry that types them."""

from __future__ import annotations

import dataclasses
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.events import EventName
from dlrover_hpc.protocol.fields import Mismatch, positional
from dlrover_hpc.protocol.fields import fields as _fields
from dlrover_hpc.protocol.fields import hints as _hints
from dlrover_hpc.protocol.fields import reader as _reader
from dlrover_hpc.protocol.wire import Frame


class NodeStatus(StrEnum):
    """What the master tells an agent about its place in the job."""

    ACTIVE = "active"  # in the current round: start workers
    FINISHED = "finished"  # the job is over: exit with exit_code
    EXCLUDED = "excluded"  # quarantined or drained: exit
    NETCHECK = "netcheck"  # run a network-check probe with this group, report, wait again


class NodeState(StrEnum):
    """A node's state in the master's table (``dlrover-hpc status`` shows it)."""

    WAITING = "waiting"  # in rendezvous (a hot spare waits here too)
    ACTIVE = "active"  # in the current round, workers running
    DONE = "done"  # workers finished successfully
    LOST = "lost"  # stopped heart-beating or disconnected
    EXCLUDED = "excluded"  # quarantined / drained: never admitted again in this job
    #: a straggler's node, swapped out: its agent waits, and a round takes it back only when
    #: it would otherwise wait with fewer than MIN nodes (slow beats stopped)
    BENCHED = "benched"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    TYPE: ClassVar[str] = ""


# --------------------------------------------------------------- agent -> master
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Join(Message):
    TYPE: ClassVar[str] = "join"
    node: str
    addr: str
    nproc: int
    slurm_node_id: int | None = None
    topology_addr: str | None = None
    agent_id: str | None = None  # set when an agent re-joins a restarted master
    network_check: bool = False  # --network-check: probe before every (re)start
    exclude_straggler: bool = False
    #: the command that started this agent and its directory: the master starts it again
    #: inside the allocation (``srun --overlap -w NODE``) when the agent dies on a healthy node
    launch_argv: list[str] = dataclasses.field(default_factory=list)
    launch_cwd: str = ""
    #: on a re-join, what the agent is doing: ``active`` (its workers train ``round``),
    #: ``done`` (they succeeded in ``round``) or ``waiting``; a restarted master adopts a
    #: round its agents still train
    round: int = 0
    round_state: NodeState = NodeState.WAITING
    master_lost_at: float = 0.0  # wall clock when its connection to the master dropped
    hang_timeout_s: float = 0.0  # --hang-timeout (0: off, -1: auto)
    straggler_factor: float = 0.0  # --straggler-factor (0: off)
    replica_port: int = 0  # its checkpoint replica server (0: none)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JoinReply(Message):
    TYPE: ClassVar[str] = "join_reply"
    agent_id: str
    job_id: str
    heartbeat_interval_s: float
    #: a round has formed before: this agent joins a running job (a spare, a replacement,
    #: a relaunch), not the job's first rendezvous
    job_running: bool = False
    #: the link timeout the master uses for this job's connections (longer in a large job:
    #: ``MasterConfig.link_timeout_in_use_s``); 0: the agent keeps its own
    link_timeout_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WaitRound(Message):
    """Long poll: answered once this agent is in a round newer than ``after_round``."""

    TYPE: ClassVar[str] = "wait_round"
    agent_id: str
    after_round: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Assignment(Message):
    TYPE: ClassVar[str] = "assignment"
    status: NodeStatus
    round: int = 0
    node_rank: int = -1
    nnodes: int = 0
    world_size: int = 0
    rank_offset: int = 0  # global rank of this node's local rank 0
    store_host: str = ""
    store_port: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = ""
    exit_code: int = 0
    reason: str = ""
    # status "netcheck": this node's place in a probe group (store_host/port: the group's store)
    check_round: int = 0
    group_rank: int = 0
    group_size: int = 0
    check_prefix: str = ""
    check_timeout_s: float = 0.0
    #: every node's checkpoint replica server "host:port" by node rank ("" where it has none);
    #: an older master's form, empty now: see replica_peer_map
    replica_peers: list[str] = dataclasses.field(default_factory=list)
    #: the replica servers ("host:port") of the node ranks (as strings) that this node's
    #: copies can go to (`replica_candidates`): a few, not every node's
    replica_peer_map: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NetcheckReport(Message):
    TYPE: ClassVar[str] = "netcheck_report"
    agent_id: str
    check_round: int
    ok: bool
    check_s: float | None
    error: str = ""


@positional
@dataclasses.dataclass(slots=True)
class RankProgress:
    """A worker's progress as its agent sees it (hang and straggler detection).

    The master builds 16,000 a second at 4,096 nodes of 8 ranks, so: not frozen, though
    nothing changes one (a frozen dataclass's ``__init__`` takes six times as long); sent as
    an array in field order and built by position (keywords take five times as long).  New
    fields go last, with a default."""

    rank: int
    step: int
    stalled_s: float  # since its step or its stack last changed
    forward_s: float = 0.0  # its newest step's time in the model's forward (0: unknown)
    at: float = 0.0  # wall clock of that step (0: unknown); the goodput report's step times
    p99_s: float = 0.0  # p99 of its recent step times (0: too few steps yet)
    compute_s: float = 0.0  # its newest step's own work (data, forward, backward, optimizer)
    wait_s: float = 0.0  # its newest step's wait for its peers
    section: str = ""  # the long phase it is in (progress.section), "" when none
    section_s: float = 0.0  # for how long
    section_bound_s: float = 0.0  # the section's own bound (0: the master's default)
    stopped_s: float = 0.0  # for how long its process has been stopped by a signal, throughout
    saved_step: int = -1  # the newest step it saved to memory (flash checkpoint; -1: none)
    #: it (and its children) computed over the agent's last CPU reading: busy, not blocked
    working: bool = False
    #: its timed steps so far (past the warm-up, overlapping no section) and the sums of their
    #: compute and wait seconds: the master's fail-slow check takes the means between reports
    timed_steps: int = 0
    compute_total_s: float = 0.0
    wait_total_s: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    agent_id: str
    round: int
    progress: list[RankProgress] = dataclasses.field(default_factory=list)
    rtt_s: float = 0.0  # how long the agent's previous heartbeat took to be answered (0: none)
    #: the median smoothed round trip (the kernel's TCP_INFO) of the node's TCP connections to
    #: other hosts that sent data since the previous heartbeat (0: none, or not read here);
    #: a node whose egress is rate-limited queues every packet (:mod:`dlrover_hpc.agent.tcp_links`)
    tcp_rtt_s: float = 0.0
    tcp_links: int = 0  # how many connections that median is over
    tcp_min_rtt_s: float = 0.0  # the lowest of their round trips


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatReply(Message):
    TYPE: ClassVar[str] = "heartbeat_reply"
    round: int  # the newest round; newer than the agent's means: stop workers, re-rendezvous
    finished: bool = False
    #: False: the master does not count this node in ``round`` (it was lost and came back
    #: while the next round waits for nodes): its workers of that round must stop
    member: bool = True


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkersStarted(Message):
    TYPE: ClassVar[str] = "workers_started"
    agent_id: str
    round: int
    pids: list[int]
    #: the same processes as the last round's, which changed rounds in-process (issue 26)
    in_process: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerFailed(Message):
    TYPE: ClassVar[str] = "worker_failed"
    agent_id: str
    round: int
    local_rank: int
    rank: int
    exit_code: int | None
    signal: str | None
    classification: str
    reason: str
    #: its node's ranks' last steps (the crash-loop guard's progress; empty: not known)
    progress: list[RankProgress] = dataclasses.field(default_factory=list)
    #: the diagnosis rule that decided the classification (``killed``: a SIGKILL without OOM
    #: evidence; "": an older agent)
    rule: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Durability:
    """A node's persists to one checkpoint directory at the end: the newest step it was
    asked to persist, the newest committed on storage, the newest failure."""

    ckpt_dir: str
    wanted: int
    durable: int  # -1: none
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkersSucceeded(Message):
    TYPE: ClassVar[str] = "workers_succeeded"
    agent_id: str
    round: int
    progress: list[RankProgress] = dataclasses.field(default_factory=list)  # the final steps
    stopped: bool = False  # they ended for a stop notice (time limit), not because training did
    #: after the node's last persists: what is on storage (empty: it persisted nothing)
    checkpoints: list[Durability] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest(Message):
    TYPE: ClassVar[str] = "status"
    #: every node's row; False: a summary when the job has more than SUMMARY_OVER nodes (the
    #: counts by state and the rows worth a look), as ``dlrover-hpc status`` asks unless --nodes
    nodes: bool = True


#: up to this many nodes ``status`` shows every one even when a summary was asked for
SUMMARY_OVER = 32


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeRow:
    """One node of a :class:`StatusReply` (not a message of its own)."""

    agent_id: str
    node: str
    rank: int
    state: NodeState
    round: int
    nproc: int
    step: int = -1  # its slowest rank's newest step in the running round (-1: none yet)
    reason: str = ""  # why it is out of the job (node_unhealthy's check and reason)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply(Message):
    TYPE: ClassVar[str] = "status_reply"
    job_id: str
    state: str
    round: int
    restart_count: int
    max_restarts: int
    nodes: list[NodeRow]
    step: int = -1  # the job's (its slowest rank's); -1: no step reported yet
    step_rate: float = 0.0  # steps per second lately
    goodput: float = -1.0  # so far, as `dlrover-hpc report` computes it (-1: unknown)
    checkpoint_step: int = -1  # the newest committed checkpoint (-1: none)
    checkpoint_age_s: float = -1.0
    #: True: ``nodes`` holds only the rows worth a look (the slowest, those not running, the
    #: stragglers'); ``node_states`` counts them all by state
    summary: bool = False
    node_states: dict[str, int] = dataclasses.field(default_factory=dict)
    stragglers: list[str] = dataclasses.field(default_factory=list)  # nodes, this round


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPart(Message):
    """A node's saver made its ranks' part of ``step`` durable."""

    TYPE: ClassVar[str] = "checkpoint_part"
    step: int
    ranks: list[int]
    world_size: int
    path: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCommit(Message):
    TYPE: ClassVar[str] = "checkpoint_commit"
    commit: bool  # True for exactly the caller that completed the set: it writes the tracker


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Event(Message):
    """An agent's or worker's event for the job's events.jsonl (the master is its one writer)."""

    TYPE: ClassVar[str] = "event"
    event: EventName
    fields: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClockRequest(Message):
    """An agent's health check asks the master's wall clock (:class:`ClockReply`); an older
    master answers with an error, and the clock check is skipped."""

    TYPE: ClassVar[str] = "clock"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClockReply(Message):
    TYPE: ClassVar[str] = "clock_reply"
    time: float  # the master's time.time() as it answered


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeUnhealthy(Message):
    """An agent's node failed a health check before it joined a round
    (:mod:`dlrover_hpc.agent.health`): the master excludes and drains it, and the agent exits
    without starting workers."""

    TYPE: ClassVar[str] = "node_unhealthy"
    agent_id: str
    check: str  # the first failed check: shm, storage, clock, gpu, program
    reason: str
    results: list[str] = dataclasses.field(default_factory=list)  # every check's line


# --------------------------------------------------------------- master -> agent
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RoundChanged(Message):
    """Push: a new rendezvous round opened; active agents stop their workers and re-join."""

    TYPE: ClassVar[str] = "round_changed"
    round: int
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LinkTick(Message):
    """Push: nothing to do.  Sent every ``link_tick_s`` so that the link always carries bytes
    the agent's kernel must acknowledge: a cut link then fails TCP_USER_TIMEOUT in time."""

    TYPE: ClassVar[str] = "tick"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StopAt(Message):
    """Push: the job ends (time limit, preemption) at the first checkpoint save at or after
    ``step``; the workers persist it and exit, by ``deadline`` (wall clock)."""

    TYPE: ClassVar[str] = "stop_at"
    step: int
    deadline: float
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PersistStep(Message):
    """Push (``--persist-every``): every rank persists its first checkpoint save at or after
    ``step`` (one held in memory too) from its node's shared memory; all nodes the same step,
    so that it commits."""

    TYPE: ClassVar[str] = "persist_step"
    step: int
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StopRequest(Message):
    """``dlrover-hpc stop``, or the job script on Slurm's signal: end the job at a step
    boundary, save, and continue it in a new run (``kind``: time_limit or preempted)."""

    TYPE: ClassVar[str] = "stop_request"
    kind: str
    reason: str = ""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankStackRow:
    rank: int
    node: str
    pid: int
    status: str  # the process's state (psutil), or "gone"
    step: int
    error: str = ""  # why the stack could not be read
    stack: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # diagnosis.stacks


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DumpStacks(Message):
    """Pushed by the master: read your workers' stacks, answer with :class:`StacksDumped`."""

    TYPE: ClassVar[str] = "dump_stacks"
    request_id: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EndWorkers(Message):
    """Pushed by the master: these ranks finished training and hang at exit (their peers
    exited 0); stop them and count them as succeeded."""

    TYPE: ClassVar[str] = "end_workers"
    ranks: list[int]
    reason: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StacksDumped(Message):
    TYPE: ClassVar[str] = "stacks_dumped"
    agent_id: str
    request_id: int
    ranks: list[RankStackRow]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StacksRequest(Message):
    """``dlrover-hpc stacks``: every rank's stack now, merged."""

    TYPE: ClassVar[str] = "stacks_request"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StacksReply(Message):
    TYPE: ClassVar[str] = "stacks_reply"
    directory: str
    text: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ErrorReply(Message):
    TYPE: ClassVar[str] = "error"
    message: str


# --------------------------------------------------------------- data sharding (worker -> master)
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardRequest(Message):
    """A training process asks for its next shard of ``dataset`` (``dlrover_hpc.data``)."""

    TYPE: ClassVar[str] = "shard_request"
    dataset: str
    size: int  # samples per epoch
    shard_size: int
    epochs: int
    round: int  # the worker's round (environ.ROUND)
    rank: int
    start: int  # batches each rank had drawn at the checkpoint this round restored
    batch_size: int  # samples per batch of this rank


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShardReply(Message):
    TYPE: ClassVar[str] = "shard_reply"
    epoch: int = -1  # -1: no shard left (every epoch is trained or being trained)
    start: int = 0  # positions [start, end) of the epoch
    end: int = 0


#: Every message kind defined above, by its TYPE.
REGISTRY: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Message) and cls.TYPE
}

M = TypeVar("M", bound=Message)


def to_frame(message: Message, *, frame_id: int | None = None) -> Frame:
    return Frame(type=message.TYPE, id=frame_id, body=_fields(message))


def from_frame(frame: Frame) -> Message:
    """The typed message of ``frame``; ProtocolError for unknown types or bad fields."""
    cls = REGISTRY.get(frame.type)
    if cls is None:
        raise ProtocolError(f"unknown message type {frame.type!r}")
    fields, body = _reader(cls), frame.body
    if not fields.keys() >= body.keys():
        unknown = set(body) - set(fields)
        raise ProtocolError(f"{frame.type}: unknown fields {sorted(unknown)}")
    values = {}
    for name, value in body.items():
        try:
            values[name] = fields[name](value)
        except Mismatch:
            hint = _hints(cls)[name]
            raise ProtocolError(f"{frame.type}.{name}: {value!r} does not match {hint}") from None
    try:
        return cls(**values)
    except TypeError as exc:
        raise ProtocolError(f"{frame.type}: {exc}") from None


def expect(message: Message, cls: type[M]) -> M:
    if isinstance(message, ErrorReply):
        raise ProtocolError(f"the master answered with an error: {message.message}")
    if not isinstance(message, cls):
        raise ProtocolError(f"expected {cls.TYPE!r}, got {message.TYPE!r}")
    return message
