"""Validated, frozen configuration of the agent (``dlrover-run``) and the job master.

No argparse here: ``dlrover_hpc.cli`` turns flags into these values; the runtime packages take
them as they are.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from enum import Enum

from dlrover_hpc.errors import ConfigError


class RequeueBy(Enum):
    """Who continues a job at a time limit or preemption (Slurm's USR1, SIGTERM)."""

    #: the master saves at a step boundary and continues the job; USR1 never reaches a worker,
    #: so a framework's own requeue (Lightning's auto-requeue) does not run as well
    DLROVER_HPC = "dlrover-hpc"
    #: the agents pass USR1 on to the workers and the master continues nothing: the
    #: framework's handler (Lightning's SLURMEnvironment, a script's own) requeues the job
    FRAMEWORK = "framework"

    @classmethod
    def parse(cls, text: str) -> RequeueBy:
        """``--requeue-by``'s value (a default from the environment skips argparse's check)."""
        try:
            return cls(text)
        except ValueError:
            choices = ", ".join(by.value for by in cls)
            raise ConfigError(f"--requeue-by={text}: expected one of {choices}") from None


class DrainMode(Enum):
    SCONTROL = "scontrol"
    QUARANTINE = "quarantine"
    OFF = "off"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeRange:
    """``--nnodes``: ``N`` or ``MIN:MAX``."""

    min: int
    max: int

    @classmethod
    def parse(cls, text: str, *, flag: str = "--nnodes") -> NodeRange:
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError(text)
        except ValueError:
            raise ConfigError(
                f"{flag}={text}: expected a node count N or a range MIN:MAX, e.g. {flag}=4 "
                f"or {flag}=2:4"
            ) from None
        return cls._checked(lo, hi, flag)

    @classmethod
    def _checked(cls, lo: int, hi: int, flag: str) -> NodeRange:
        if lo < 1:
            raise ConfigError(f"{flag}={lo}:{hi}: the minimum must be at least 1")
        if lo > hi:
            raise ConfigError(
                f"{flag}={lo}:{hi}: the minimum is larger than the maximum; "
                f"write MIN:MAX with MIN <= MAX, e.g. {flag}={hi}:{lo}"
            )
        return cls(min=lo, max=hi)

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


def parse_nproc(text: str) -> int:
    """``--nproc-per-node``: a number, or torchrun's ``auto``/``cpu``/``gpu``."""
    if text in ("auto", "gpu"):
        import torch  # only when asked: importing torch is slow

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
        if text == "gpu":
            raise ConfigError("--nproc-per-node=gpu: no CUDA device is visible on this node")
        text = "cpu"
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node={text}: expected a number of workers or auto, cpu, gpu"
        ) from None
    if value < 1:
        raise ConfigError(f"--nproc-per-node={value}: needs at least 1 worker per node")
    return value


def parse_host_port(text: str, *, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag}={text}: expected HOST:PORT, e.g. {flag}=node1:29400")
    return host.strip("[]"), int(port)


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``KEY=VALUE,...`` (torchrun's spelling)."""
    out: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf={text}: expected KEY=VALUE,..., got {item!r}")
        out[key.strip()] = value.strip()
    return out


#: ``--link-timeout``: seconds the agent <-> master connection may go unacknowledged
#: (TCP_USER_TIMEOUT; keepalive when it is idle) before it fails.  A cut link stalls every
#: survivor's collective, so this is most of what a link cut costs.  The master's link ticks
#: (``link_tick_s``) keep data in flight, so the kernel gives up this long after the first tick
#: past the cut, not at its next whole-second keepalive probe.  1 s of no acknowledgement is
#: three lost transmissions (Linux retransmits after 0.2 and 0.6 s); the acknowledgements come
#: from the peer's kernel, so a busy agent or master does not delay them, and a link
#: rate-limited to 256 kbit and full left at most 0.52 s unacknowledged in 120 s here.
DEFAULT_LINK_TIMEOUT_S = 1.0
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


#: ``--scale-up-wait``: how long a scale-up (a node returning to a job running below MAX) may
#: wait for the next checkpoint, so that the restart that takes the node in redoes no step.
DEFAULT_SCALE_UP_WAIT_S = 300.0


#: ``--reconnect-timeout``: how long an agent whose master connection dropped keeps trying to
#: reconnect (its workers train on meanwhile) before it stops them and exits.
DEFAULT_RECONNECT_TIMEOUT_S = 120.0


#: ``--hang-timeout auto`` (the default): how long no rank may progress is learned from the
#: job's own step times, with its own bound for each long phase (:mod:`dlrover_hpc.master.hangs`);
#: a number of seconds is a fixed bound for everything; 0 is off.  ``auto`` is this sentinel.
HANG_AUTO = -1.0
#: With ``auto`` no bound is longer than this (gloo's and NCCL's own collective timeout).
HANG_CEILING_S = 1800.0
DEFAULT_HANG_TIMEOUT = "auto"


def parse_hang_timeout(text: str, flag: str = "--hang-timeout") -> float:
    """``auto`` (:data:`HANG_AUTO`), 0 (off) or a positive number of seconds."""
    if text.strip().lower() == "auto":
        return HANG_AUTO
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):  # -1 too: auto is spelt "auto"
        raise ConfigError(
            f"{flag}={text}: must be auto, 0 (off) or seconds, e.g. {flag}={HANG_CEILING_S:g}"
        )
    return value


def describe_hang_timeout(value: float) -> str:
    return "auto" if value == HANG_AUTO else ("off" if value == 0 else f"{value:g} s")


#: ``--straggler-factor``: a rank whose compute per step (data, forward, backward, optimizer)
#: takes this many times its peers' median while they wait for it, for 20 s, is a runtime
#: straggler (fail-slow; :func:`dlrover_hpc.master.hangs.stragglers`); 0 is off.
DEFAULT_STRAGGLER_FACTOR = 2.0


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


def env_default(name: str, default: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Default of a flag from ``DLROVER_HPC_<NAME>`` (flags win over the environment)."""
    env = os.environ if env is None else env
    return env.get("DLROVER_HPC_" + name.upper().replace("-", "_"), default)


#: The most heartbeats a second the master is sent (see MasterConfig.heartbeat_every_s): each
#: costs it ~0.25 ms of its one core (benchmarks/scale.py), so 512 a second are ~12 % of it.
HEARTBEATS_PER_S = 512


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MasterConfig:
    host: str = "0.0.0.0"
    port: int = 0
    nnodes: NodeRange = NodeRange(min=1, max=1)
    node_unit: int = 1
    topology: str | None = None
    drain: DrainMode = DrainMode.SCONTROL
    job_dir: str = ".dlrover-hpc"
    job_id: str = "standalone"
    max_restarts: int = 3
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 15.0
    last_call_s: float = 3.0
    rendezvous_timeout_s: float = 600.0
    min_nodes_timeout_s: float = 300.0
    netcheck_timeout_s: float = 30.0
    link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S  # a silent agent connection fails after this
    #: a node that could join the running round (returning, or a replacement) waits for the
    #: next checkpoint at most this long (0: it joins at once; ``--scale-up-wait``)
    scale_up_wait_s: float = DEFAULT_SCALE_UP_WAIT_S
    replacement_sbatch: str | None = None  # template of replacement jobs; None: no replacements
    requeue: bool = True  # below MIN nodes for min_nodes_timeout_s: scontrol requeue (Slurm)
    embedded: bool = False  # runs inside an agent (no master step): said in master.json
    #: ``--hang-timeout`` (0: take the agents'; :data:`HANG_AUTO`: learned from the step times)
    hang_timeout_s: float = 0.0
    metrics_port: int = 0  # Prometheus metrics on http://HOST:PORT/metrics; 0: off
    #: time limits and preemption: new runs of the job (requeue or resubmission); 0: none
    max_continuations: int = 5
    #: seconds before the time limit at which the master stops the job on its own (0: never)
    stop_lead_s: float = 90.0
    #: FRAMEWORK: no continuation, no stop ahead of the time limit, USR1 ignored
    requeue_by: RequeueBy = RequeueBy.DLROVER_HPC

    @property
    def heartbeat_every_s(self) -> float:
        """The heartbeat interval the agents are told: ``heartbeat_interval_s``, longer for
        a job so large that the master would answer more than :data:`HEARTBEATS_PER_S`
        heartbeats a second (2 s up to 1,024 nodes; 8 s at 4,096).  Liveness does not wait
        for heartbeats (a cut link fails after ``link_timeout_s``); they carry progress."""
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
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat interval {self.heartbeat_interval_s} s must be shorter than the "
                f"heartbeat timeout {self.heartbeat_timeout_s} s"
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
    link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S  # a silent master connection fails after this
    reconnect_timeout_s: float = DEFAULT_RECONNECT_TIMEOUT_S
    #: the command line that started this agent (the master relaunches it with it); () unknown
    launch_argv: tuple[str, ...] = ()
    #: ``--rdzv-endpoint HOST[:PORT]``: with no master running, the agent on HOST embeds one
    rdzv_endpoint: str = ""
    hang_timeout_s: float = HANG_AUTO
    straggler_factor: float = DEFAULT_STRAGGLER_FACTOR  # 0: no forward timing
    requeue_by: RequeueBy = RequeueBy.DLROVER_HPC  # does Slurm's USR1 reach the workers?
    #: what the agent does not put into its workers (names of dlrover_hpc.injections.ALL)
    off: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        nnodes = self.nnodes
        if self.standalone and self.master:
            raise ConfigError(
                "--standalone runs its own in-process master; drop --master "
                "(or unset DLROVER_HPC_MASTER) or drop --standalone"
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
        if not (self.reconnect_timeout_s >= 0 and math.isfinite(self.reconnect_timeout_s)):
            raise ConfigError(
                f"--reconnect-timeout={self.reconnect_timeout_s:g}: must be 0 (exit at once when "
                f"the master's connection drops) or more seconds, e.g. "
                f"--reconnect-timeout={DEFAULT_RECONNECT_TIMEOUT_S:g}"
            )
