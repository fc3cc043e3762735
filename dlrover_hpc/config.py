"""Validated, frozen configuration of the agent (``dlrover-run``) and the job master.

No argparse here: ``dlrover_hpc.cli`` turns flags into these values; the runtime packages take
them as they are.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from dlrover_hpc import settings
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.settings import Setting

# The value types live beneath the settings' declarations; their importers find them here.
from dlrover_hpc.values import HANG_AUTO as HANG_AUTO
from dlrover_hpc.values import HANG_CEILING_S as HANG_CEILING_S
from dlrover_hpc.values import DrainMode as DrainMode
from dlrover_hpc.values import NodeRange as NodeRange
from dlrover_hpc.values import RequeueBy as RequeueBy
from dlrover_hpc.values import describe_hang_timeout as describe_hang_timeout
from dlrover_hpc.values import parse_hang_timeout as parse_hang_timeout
from dlrover_hpc.values import parse_host_port as parse_host_port
from dlrover_hpc.values import parse_nproc as parse_nproc
from dlrover_hpc.values import parse_rdzv_conf as parse_rdzv_conf

#: ``--link-timeout``'s default (:data:`dlrover_hpc.settings.LINK_TIMEOUT`).
DEFAULT_LINK_TIMEOUT_S = settings.LINK_TIMEOUT.default
#: The master's link ticks: at most this many a second over all agents (see
#: ``MasterConfig.link_tick_s``); past that the keepalive probes alone find a cut link.
LINK_TICKS_PER_S = 1024
#: A link that only keepalive watches (a job too large for ticks) fails no sooner than this.
#: Keepalive probes are whole seconds apart, so a 1 s timeout is a single probe: one lost probe
#: or acknowledgement ends a healthy connection.  Probes of connections that went idle together
#: (a round's assignments, a stop notice) leave together: 16,384 simulated agents waiting for
#: their round here lost ~10,000 of them in the kernel's input queue and every connection from
#: the 13,600th on (issue 29).  3 s is two probes a second apart, and a retransmission between.
KEEPALIVE_LINK_TIMEOUT_S = 3.0


def check_link_timeout(value: float) -> None:
    """``--link-timeout``: a positive, finite number of seconds."""
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"--link-timeout={value:g}: must be a positive number of seconds, e.g. "
            f"--link-timeout={DEFAULT_LINK_TIMEOUT_S:g}"
        )


DEFAULT_SCALE_UP_WAIT_S = settings.SCALE_UP_WAIT.default
DEFAULT_RECONNECT_TIMEOUT_S = settings.RECONNECT_TIMEOUT.default


DEFAULT_STRAGGLER_FACTOR = settings.STRAGGLER_FACTOR.default


def check_seconds(
    flag: str, value: float, example: float, *, auto: bool = False, text: str | None = None
) -> None:
    """0 (off) or a positive, finite number of seconds (or ``auto``, where ``auto`` is allowed)."""
    if auto and value == HANG_AUTO:
        return
    if not (value >= 0 and math.isfinite(value)):
        shown = text if text is not None else f"{value:g}"
        also = "auto, " if auto else ""
        raise ConfigError(
            f"{flag}={shown}: must be {also}0 (off) or seconds, e.g. {flag}={example:g}"
        )


def env_default(setting: Setting[Any], env: Mapping[str, str] | None = None) -> Any:
    """Default of a flag from its variable, else its built-in text (flags win over both)."""
    env = os.environ if env is None else env
    return env.get(setting.env, setting.text)


#: The most heartbeats a second the master is sent (see MasterConfig.heartbeat_every_s): each
#: costs it ~0.25 ms of its one core (benchmarks/scale.py), so 512 a second are ~12 % of it.
HEARTBEATS_PER_S = 512


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MasterConfig:
    host: str = settings.HOST.default
    port: int = settings.PORT.default
    nnodes: NodeRange = settings.NNODES.default
    node_unit: int = settings.NODE_UNIT.default
    segment: int = settings.SEGMENT.default
    topology: str | None = settings.TOPOLOGY.default
    drain: DrainMode = settings.DRAIN.default
    job_dir: str = ".dlrover-hpc"
    job_id: str = "standalone"
    max_restarts: int = settings.MAX_RESTARTS.default
    #: the agents' heartbeat interval up to HEARTBEATS_PER_S nodes (see heartbeat_every_s)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = settings.HEARTBEAT_TIMEOUT.default
    last_call_s: float = settings.LAST_CALL.default
    rendezvous_timeout_s: float = 600.0
    min_nodes_timeout_s: float = settings.MIN_NODES_TIMEOUT.default
    netcheck_timeout_s: float = settings.NETCHECK_TIMEOUT.default
    #: a silent agent connection fails after this
    link_timeout_s: float = settings.LINK_TIMEOUT.default
    #: a node that could join the running round (returning, or a replacement) waits for the
    #: next checkpoint at most this long (0: it joins at once; ``--scale-up-wait``)
    scale_up_wait_s: float = settings.SCALE_UP_WAIT.default
    #: template of replacement jobs; None: no replacements
    replacement_sbatch: str | None = settings.REPLACEMENT_SBATCH.default
    #: below MIN nodes for min_nodes_timeout_s: scontrol requeue (Slurm)
    requeue: bool = settings.REQUEUE.default
    embedded: bool = False  # runs inside an agent (no master step): said in master.json
    #: ``--hang-timeout`` (0: take the agents'; :data:`HANG_AUTO`: learned from the step times)
    hang_timeout_s: float = settings.MASTER_HANG_TIMEOUT.default
    #: Prometheus metrics on http://HOST:PORT/metrics; 0: off
    metrics_port: int = settings.METRICS_PORT.default
    #: time limits and preemption: new runs of the job (requeue or resubmission); 0: none
    max_continuations: int = settings.MAX_CONTINUATIONS.default
    #: seconds before the time limit at which the master stops the job on its own (0: never)
    stop_lead_s: float = settings.STOP_LEAD.default
    #: FRAMEWORK: no continuation, no stop ahead of the time limit, USR1 ignored
    requeue_by: RequeueBy = settings.REQUEUE_BY.default
    #: failed rounds in a row without progress that stop the job (master/crash_loop.py); 0: off
    crash_loop_rounds: int = settings.CRASH_LOOP_ROUNDS.default
    #: persist a step held in memory this often (master/auto_persist.py); PERSIST_AUTO, 0: off
    persist_every_s: float = settings.PERSIST_EVERY.default
    node_mtbf_s: float = settings.NODE_MTBF.default  # the site's, per node (--persist-every auto)

    @property
    def heartbeat_every_s(self) -> float:
        """The heartbeat interval the agents are told: ``heartbeat_interval_s``, longer for
        a job so large that the master would answer more than :data:`HEARTBEATS_PER_S`
        heartbeats a second (1 s up to 512 nodes, 2 s at 1,024, 8 s at 4,096).  Liveness does
        not wait for heartbeats (a cut link fails after ``link_timeout_s``); they carry the
        progress, step times and TCP round trips the hang and fail-slow verdicts compare, so
        a smaller job, which leaves the master's budget unspent, has them sooner (a slow link
        was found ~5 s after its onset at 2 s)."""
        return max(self.heartbeat_interval_s, self.nnodes.max / HEARTBEATS_PER_S)

    @property
    def link_timeout_in_use_s(self) -> float:
        """The link timeout of this job's connections, both ends (the agents are told it in
        their :class:`JoinReply`): ``link_timeout_s`` while the master's ticks keep data in
        flight on every link, and at least :data:`KEEPALIVE_LINK_TIMEOUT_S` in a job too large
        for ticks (past 256 nodes with the 1 s default), where keepalive alone watches."""
        if self.link_tick_s is not None:
            return self.link_timeout_s
        return max(self.link_timeout_s, KEEPALIVE_LINK_TIMEOUT_S)

    @property
    def link_tick_s(self) -> float | None:
        """How often the master writes a tick to every agent, so that a cut link always has
        data unacknowledged and fails within ``link_timeout_s`` plus a tick: a tenth of
        ``link_timeout_s`` (0.1 s by default), or as often as :data:`LINK_TICKS_PER_S` writes
        a second allow (past 102 nodes by default), down to a quarter of it.  None (no ticks)
        where even that would be more writes (past 256 nodes by default): there the kernel's
        keepalive probes, whole seconds apart, find a cut link within ``link_timeout_s`` plus
        a second."""
        every = max(self.link_timeout_s / 10, self.nnodes.max / LINK_TICKS_PER_S)
        return every if every <= self.link_timeout_s / 4 else None

    @property
    def heartbeat_silence_s(self) -> float:
        """An agent with no heartbeat for this long is lost: ``heartbeat_timeout_s``, and
        at least three of :attr:`heartbeat_every_s`."""
        return max(self.heartbeat_timeout_s, 3 * self.heartbeat_every_s)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port}: expected 0 (pick a free port) to 65535")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(
                f"--metrics-port={self.metrics_port}: expected 1 to 65535 (0: no metrics)"
            )
        if self.node_unit < 1:
            raise ConfigError(f"--node-unit={self.node_unit}: must be at least 1")
        if self.node_unit > self.nnodes.max:
            raise ConfigError(
                f"--node-unit={self.node_unit} is larger than the maximum node count "
                f"{self.nnodes.max}; lower --node-unit or raise --nnodes"
            )
        check_segment(self.segment, self.node_unit, self.nnodes)
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"--heartbeat-timeout={self.heartbeat_timeout_s:g}: must be longer than the "
                f"heartbeat interval ({self.heartbeat_interval_s:g} s); fix: give more seconds, "
                f"e.g. --heartbeat-timeout={settings.HEARTBEAT_TIMEOUT.default:g}"
            )
        check_link_timeout(self.link_timeout_s)
        check_seconds("--scale-up-wait", self.scale_up_wait_s, DEFAULT_SCALE_UP_WAIT_S)
        check_seconds("--hang-timeout", self.hang_timeout_s, HANG_CEILING_S, auto=True)
        if self.max_continuations < 0:
            raise ConfigError(
                f"--max-continuations={self.max_continuations}: must be 0 (never continue) or more"
            )
        if self.stop_lead_s < 0:
            raise ConfigError(f"--stop-lead={self.stop_lead_s:g}: must be 0 (off) or more seconds")
        check_crash_loop_rounds(self.crash_loop_rounds)


def check_crash_loop_rounds(rounds: int) -> None:
    if rounds < 0:
        raise ConfigError(
            f"--crash-loop-rounds={rounds}: must be 0 (off) or more rounds, "
            f"e.g. --crash-loop-rounds={settings.CRASH_LOOP_ROUNDS.default}"
        )


def _check_std_streams(flag: str, value: str) -> None:
    ok = value in ("0", "1", "2", "3") or all(
        part.count(":") == 1 and all(x.isdigit() for x in part.split(":"))
        for part in value.split(",")
    )
    if not ok:
        raise ConfigError(f"{flag}={value}: expected 0, 1, 2, 3 or LOCAL_RANK:VALUE,...")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One agent (``dlrover-run``); checked at construction, errors name the flag and the fix."""

    nnodes: NodeRange
    nproc_per_node: int
    standalone: bool
    master: tuple[str, int] | None
    max_restarts: int
    monitor_interval_s: float
    start_method: str
    role: str
    module: bool
    no_python: bool
    log_dir: str | None
    redirects: str
    tee: str
    local_ranks_filter: str
    local_addr: str | None
    shutdown_timeout_s: float
    network_check: bool
    exclude_straggler: bool
    node_unit: int
    job_dir: str | None
    run_id: str | None
    rdzv_conf: dict[str, str]
    training_script: str
    training_script_args: tuple[str, ...]
    #: a silent master connection fails after this
    link_timeout_s: float = settings.LINK_TIMEOUT.default
    reconnect_timeout_s: float = settings.RECONNECT_TIMEOUT.default
    #: the command line that started this agent (the master relaunches it with it); () unknown
    launch_argv: tuple[str, ...] = ()
    #: ``--rdzv-endpoint HOST[:PORT]``: with no master running, the agent on HOST embeds one
    rdzv_endpoint: str = settings.RDZV_ENDPOINT.default
    hang_timeout_s: float = settings.HANG_TIMEOUT.default
    straggler_factor: float = settings.STRAGGLER_FACTOR.default  # 0: no forward timing
    #: does Slurm's USR1 reach the workers?
    requeue_by: RequeueBy = settings.REQUEUE_BY.default
    #: what the agent does not put into its workers (names of dlrover_hpc.injections.ALL)
    off: frozenset[str] = frozenset()
    #: torchrun's --virtual-local-rank: LOCAL_RANK=0 and one visible GPU per worker
    virtual_local_rank: bool = settings.VIRTUAL_LOCAL_RANK.default
    #: --health-check: the site's node check, run before joining ("": none)
    health_check: str = settings.HEALTH_CHECK.default
    health_check_timeout_s: float = settings.HEALTH_CHECK_TIMEOUT.default
    #: --local-ckpt-dir: the node-local checkpoint tier ("": none)
    local_ckpt_dir: str = settings.LOCAL_CKPT_DIR.default
    #: the crash-loop guard of an in-process master (copied by :func:`embedded_master_config`)
    crash_loop_rounds: int = settings.CRASH_LOOP_ROUNDS.default
    #: an in-process master's --persist-every and --node-mtbf (copied by embedded_master_config)
    persist_every_s: float = settings.PERSIST_EVERY.default
    node_mtbf_s: float = settings.NODE_MTBF.default
    #: --segment: node ranks in groups of N nodes inside one block (copied by
    #: embedded_master_config)
    segment: int = settings.SEGMENT.default

    def __post_init__(self) -> None:
        nnodes = self.nnodes
        if self.standalone and self.master:
            raise ConfigError(
                "--standalone runs its own in-process master; drop --master "
                f"(or unset {settings.MASTER.env}) or drop --standalone"
            )
        if self.standalone and nnodes.max != 1:
            raise ConfigError(f"--standalone is for one node; got --nnodes={nnodes}")
        check_seconds("--hang-timeout", self.hang_timeout_s, HANG_CEILING_S, auto=True)
        if self.straggler_factor and not (1 < self.straggler_factor < math.inf):
            raise ConfigError(
                f"--straggler-factor={self.straggler_factor:g}: must be 0 (off) or more than 1, "
                "e.g. --straggler-factor=2"
            )
        if self.node_unit < 1:
            raise ConfigError(f"--node-unit={self.node_unit}: must be at least 1")
        if self.node_unit > nnodes.max:
            raise ConfigError(
                f"--node-unit={self.node_unit} is larger than --nnodes maximum {nnodes.max}; "
                "lower --node-unit or raise the maximum"
            )
        if nnodes.max // self.node_unit * self.node_unit < nnodes.min:
            raise ConfigError(
                f"--nnodes={nnodes} with --node-unit={self.node_unit}: no multiple of "
                f"{self.node_unit} lies between {nnodes.min} and {nnodes.max}"
            )
        check_segment(self.segment, self.node_unit, nnodes)
        if self.nproc_per_node < 1:
            raise ConfigError(
                f"--nproc-per-node={self.nproc_per_node}: needs at least 1 worker per node"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        if self.monitor_interval_s <= 0:
            raise ConfigError(f"--monitor-interval={self.monitor_interval_s}: must be > 0")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"--shutdown-timeout={self.shutdown_timeout_s:g}: must be 0 or more")
        if self.module and self.no_python:
            raise ConfigError("--module and --no-python exclude each other; pick one")
        if not self.training_script:
            raise ConfigError("no training script; give it after the flags, e.g. train.py")
        _check_std_streams("--redirects", self.redirects)
        _check_std_streams("--tee", self.tee)
        check_link_timeout(self.link_timeout_s)
        check_crash_loop_rounds(self.crash_loop_rounds)
        if self.local_ckpt_dir and not os.path.isabs(self.local_ckpt_dir):
            raise ConfigError(
                f"--local-ckpt-dir={self.local_ckpt_dir}: expected an absolute path on the "
                "node's own disk, e.g. --local-ckpt-dir=/local/scratch/ckpt"
            )
        if not (0 < self.health_check_timeout_s < math.inf):
            raise ConfigError(
                f"--health-check-timeout={self.health_check_timeout_s:g}: must be more than 0 "
                "seconds, e.g. --health-check-timeout=60"
            )
        if not (self.reconnect_timeout_s >= 0 and math.isfinite(self.reconnect_timeout_s)):
            raise ConfigError(
                f"--reconnect-timeout={self.reconnect_timeout_s:g}: must be 0 (exit at once when "
                f"the master's connection drops) or more seconds, e.g. "
                f"--reconnect-timeout={DEFAULT_RECONNECT_TIMEOUT_S:g}"
            )


def check_segment(segment: int, node_unit: int, nnodes: NodeRange) -> None:
    """``--segment``: at least 1, and a multiple of it (and of ``--node-unit``) fits MIN:MAX."""
    if segment < 1:
        raise ConfigError(f"--segment={segment}: must be at least 1 (1: no segments)")
    unit = math.lcm(segment, node_unit)
    if nnodes.max // unit * unit < nnodes.min:
        also = f" and --node-unit={node_unit}" if node_unit > 1 else ""
        raise ConfigError(
            f"--segment={segment}{also} with --nnodes={nnodes}: no multiple of {unit} lies"
            f" between {nnodes.min} and {nnodes.max}; pick a --segment that divides a node count"
            " in that range"
        )


def embedded_master_config(
    run: RunConfig,
    *,
    host: str,
    port: int,
    job_dir: str,
    job_id: str,
    embedded: bool = False,
    requeue: bool = settings.REQUEUE.default,
    last_call_s: float = settings.LAST_CALL.default,
) -> MasterConfig:
    """The config of a master that an agent runs in-process (``--standalone``, or the embedded
    master of a torchrun-style job): every setting that ``dlrover-run`` and ``dlrover-hpc
    master`` both take comes from the agent's ``run`` (its ``--requeue-by`` too, so that a
    framework's requeue is not doubled by the master's own), the rest from the arguments."""
    copied = {
        field: getattr(run, field)
        for setting in settings.shared(settings.Command.RUN, settings.Command.MASTER)
        if (field := setting.config_field) and setting is not settings.JOB_DIR
    }
    return MasterConfig(
        host=host,
        port=port,
        job_dir=job_dir,
        job_id=job_id,
        embedded=embedded,
        requeue=requeue,
        last_call_s=last_call_s,
        **copied,
    )
