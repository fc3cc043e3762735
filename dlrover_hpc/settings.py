"""Every setting of ``dlrover-run``, ``dlrover-hpc master`` and ``dlrover-hpc launch``, each
declared once (issue 47): its flags, kind and choices, built-in default, parser, the commands
that take it, its environment variable and its help.

The parsers (``dlrover_hpc.cli``), the TOML files' checks (which follow the parsers), the reading
of the environment and the dataclasses of :mod:`dlrover_hpc.config` are all made from these
declarations, so a setting's spelling, default and variable cannot drift between them.

A setting's key is its TOML key and its argparse dest; its variable is :data:`PREFIX` and the
key in capitals unless it declares another.  Two commands share one declaration only where the
flag, the key, the variable and the default are the same; the run's and the master's
``--hang-timeout`` differ in default and variable, so they are two.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from dlrover_hpc import environ
from dlrover_hpc.values import (
    HANG_AUTO,
    DrainMode,
    NodeRange,
    RequeueBy,
    parse_duration,
    parse_hang_timeout,
    parse_host_port,
    parse_nproc,
    parse_persist_every,
    parse_rdzv_conf,
)

#: The prefix of every dlrover-hpc environment variable.
PREFIX = environ.PREFIX

T = TypeVar("T")


class Kind(enum.Enum):
    """How a setting's flag takes its value (and which argparse type checks it)."""

    TEXT = "text"  # a string, given on as it is; its parser (if any) runs when the config is made
    INT = "int"
    FLOAT = "float"
    SWITCH = "switch"  # --flag turns it on
    ON_OFF = "on-off"  # --flag / --no-flag (argparse.BooleanOptionalAction)


class Treatment(enum.Enum):
    """How ``dlrover-run`` treats one of torchrun's flags."""

    SAME = "same"  # accepted, with torchrun's meaning and default
    DIFFERENT = "different"  # accepted, with a meaning or default of its own (``why`` says how)
    IGNORED = "ignored"  # accepted, and a warning names it once at start when given
    REFUSED = "refused"  # exit 2 naming it, why, and what to do instead, when given


@dataclasses.dataclass(frozen=True, slots=True)
class Parity:
    """How ``dlrover-run`` treats one of torchrun's flags (``torch.distributed.run``'s parser;
    tests/cli/test_torchrun_parity.py holds the two together).  ``why``: how it differs, why it
    is ignored, or why it is refused and what to do instead; none for :attr:`Treatment.SAME`."""

    treatment: Treatment
    why: str = ""

    def __post_init__(self) -> None:
        if (self.treatment is Treatment.SAME) != (not self.why):
            raise ValueError(f"Parity({self.treatment.name}): a reason goes with all but SAME")


#: torchrun's meaning and default.
SAME = Parity(Treatment.SAME)


def different(how: str) -> Parity:
    return Parity(Treatment.DIFFERENT, how)


def ignored(why: str) -> Parity:
    return Parity(Treatment.IGNORED, why)


def refused(why: str) -> Parity:
    return Parity(Treatment.REFUSED, why)


class Command(enum.Enum):
    """Who takes a setting; ``run`` and ``master`` are also the TOML files' sections."""

    RUN = "run"  # dlrover-run
    MASTER = "master"  # dlrover-hpc master
    LAUNCH = "launch"  # dlrover-hpc launch (bare metal): these are read from the environment
    FILES = "files"  # where the TOML files are: the environment only


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Setting(Generic[T]):
    """One setting.  ``default`` is typed (what the config holds when nothing sets it);
    ``spelled`` is the same default as the flag's text, where ``str(default)`` is not it."""

    key: str
    flags: tuple[str, ...] = ()  # none: the environment only
    kind: Kind = Kind.TEXT
    default: T
    spelled: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # the flag's text -> the config's value
    field: str | None = ""  # the RunConfig/MasterConfig field ("": the key); None: none
    env_name: str = ""  # "": PREFIX + KEY
    in_file: bool = True  # whether a TOML file may set it
    torchrun: Parity | None = None  # one of torchrun's flags: how dlrover-run treats it
    metavar: str | None = None
    help: str | Mapping[Command, str] = ""

    @property
    def env(self) -> str:
        """The environment variable that sets it."""
        return self.env_name or PREFIX + self.key.upper()

    @property
    def flag(self) -> str:
        """The long flag, as errors name it."""
        return next(f for f in self.flags if f.startswith("--"))

    @property
    def config_field(self) -> str | None:
        return self.key if self.field == "" else self.field

    @property
    def text(self) -> str | bool | None:
        """The default as the parser's default: the flag's text, or a switch's bool."""
        if self.spelled is not None:
            return self.spelled
        value: object = self.default
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, enum.Enum):
            return str(value.value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    def flags_in(self, command: Command) -> tuple[str, ...]:
        """Its flags in ``command``: torchrun's underscore spellings are dlrover-run's only."""
        if command is Command.RUN:
            return self.flags
        return tuple(f for f in self.flags if "_" not in f)

    def option_strings(self, command: Command) -> tuple[str, ...]:
        """Every option string its parser accepts (an on/off flag's ``--no-`` form too)."""
        flags = self.flags_in(command)
        if self.kind is Kind.ON_OFF:
            return (*flags, *("--no-" + f[2:] for f in flags if f.startswith("--")))
        return flags

    def help_for(self, command: Command) -> str:
        """Its help; a torchrun flag that dlrover-run ignores or refuses says why."""
        parity = self.torchrun
        if parity is not None and parity.treatment in (Treatment.IGNORED, Treatment.REFUSED):
            return f"torchrun's; {parity.treatment.value}: {parity.why}"
        return self.help if isinstance(self.help, str) else self.help[command]


def _torchrun(name: str) -> tuple[str, ...]:
    """torchrun accepts both --nproc-per-node and --nproc_per_node spellings."""
    dashed = f"--{name}"
    under = "--" + name.replace("-", "_")
    return (dashed,) if under == dashed else (dashed, under)


# ------------------------------------------------------------------ both dlrover-run and master
NNODES: Setting[NodeRange] = Setting(
    key="nnodes",
    flags=("--nnodes",),
    default=NodeRange(min=1, max=1),
    parse=NodeRange.parse,
    torchrun=SAME,
    help={
        Command.RUN: "number of nodes, or MIN:MAX for an elastic job (default 1:1)",
        Command.MASTER: "N or MIN:MAX nodes in the training group",
    },
)
NODE_UNIT = Setting(
    key="node_unit",
    flags=("--node-unit",),
    kind=Kind.INT,
    default=1,
    help={
        Command.RUN: "admit nodes only in multiples of N (default 1)",
        Command.MASTER: "admit nodes only in multiples of N",
    },
)
SEGMENT = Setting(
    key="segment",
    flags=("--segment",),
    kind=Kind.INT,
    default=1,
    help={
        Command.RUN: "node ranks in groups of N nodes, each group inside one block of the"
        " topology (Slurm's --segment; default 1: off)",
        Command.MASTER: "node ranks in groups of N nodes, each inside one block of --topology;"
        " rounds admit whole segments and a spare replaces a lost node within its block",
    },
)
MAX_RESTARTS = Setting(
    key="max_restarts",
    flags=_torchrun("max-restarts"),
    kind=Kind.INT,
    default=3,
    torchrun=different(
        "counted for the whole job (a restart of any node's workers counts once), not per "
        "agent; default 3, not 0"
    ),
    help={
        Command.RUN: "worker-group restarts allowed for the whole job (counted per job, "
        "not per agent as torchrun does; default 3)",
        Command.MASTER: "worker-group restarts allowed for the whole job (default 3)",
    },
)
JOB_DIR: Setting[str | None] = Setting(
    key="job_dir",
    flags=("--job-dir",),
    default=None,
    help="job directory (default $SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID)",
)
#: ``--link-timeout``: seconds the agent <-> master connection may go unacknowledged
#: (TCP_USER_TIMEOUT; keepalive when it is idle) before it fails.  A cut link stalls every
#: survivor's collective, so this is most of what a link cut costs.  The master's link ticks
#: (``link_tick_s``) keep data in flight, so the kernel gives up this long after the first tick
#: past the cut, not at its next whole-second keepalive probe.  1 s of no acknowledgement is
#: three lost transmissions (Linux retransmits after 0.2 and 0.6 s); the acknowledgements come
#: from the peer's kernel, so a busy agent or master does not delay them, and a link
#: rate-limited to 256 kbit and full left at most 0.52 s unacknowledged in 120 s here.
LINK_TIMEOUT = Setting(
    key="link_timeout",
    flags=("--link-timeout",),
    kind=Kind.FLOAT,
    default=1.0,
    field="link_timeout_s",
    help={
        Command.RUN: "seconds of silence before the connection to the master fails (TCP "
        "keepalive and TCP_USER_TIMEOUT; default 1)",
        Command.MASTER: "seconds of silence before an agent's connection fails (TCP keepalive "
        "and TCP_USER_TIMEOUT), so a node whose link is cut is lost within seconds, not after "
        "--heartbeat-timeout (default 1)",
    },
)
REQUEUE_BY = Setting(
    key="requeue_by",
    flags=("--requeue-by",),
    default=RequeueBy.DLROVER_HPC,
    choices=tuple(by.value for by in RequeueBy),
    parse=RequeueBy.parse,
    help={
        Command.RUN: "who continues the job at a time limit or preemption: dlrover-hpc "
        "(default: the master saves at a step boundary and requeues; Slurm's USR1 never reaches "
        "a worker, so a framework's own requeue does not run as well) or framework (the agents "
        "pass USR1 on to the workers, the master continues nothing: Lightning's auto-requeue or "
        "the script's own handler requeues); give the master the same value",
        Command.MASTER: "who continues the job at a time limit or preemption: dlrover-hpc "
        "(default) or framework (USR1 ignored here, no stop ahead of the limit, no continuation: "
        "the workers' framework requeues); the agents' --requeue-by, as train.sbatch passes it",
    },
)
CONFIG: Setting[str | None] = Setting(
    key="config",
    flags=("--config",),
    default=None,
    field=None,
    in_file=False,
    metavar="FILE",
    help={
        command: f"TOML file of flag defaults ([{command.value}] section), over the user's and "
        f"the site's (default ${PREFIX}CONFIG); see 'dlrover-hpc config show'"
        for command in (Command.RUN, Command.MASTER)
    },
)
#: Where the site's file is (set empty: none); ``--config``'s variable names the job's own.
SITE_CONFIG: Setting[str | None] = Setting(
    key="site_config", default=None, field=None, in_file=False
)

#: ``--persist-every`` (issue 49): the master has every node persist the same step held in
#: memory when storage's newest step is this old: ``auto`` (Young/Daly from the measured
#: persist time and the job's MTBF, :mod:`dlrover_hpc.master.persist_interval`), a duration,
#: or off (the default: only the script's DISK saves persist).
PERSIST_EVERY = Setting(
    key="persist_every",
    flags=("--persist-every",),
    default=0.0,
    spelled="off",
    parse=lambda text: parse_persist_every(text),
    field="persist_every_s",
    help="persist a step every rank holds in memory when storage's newest step is this old, "
    "also when the script saves only to memory: auto (Young/Daly: sqrt(2 x persist time x "
    "the job's MTBF) - persist time, from the measured persists and the failures seen, else "
    "--node-mtbf), a duration (e.g. 600 or 10m), or off (default: only the script's DISK "
    "saves persist)",
)
#: ``--node-mtbf``: the site's mean time between failures of one node, for ``--persist-every
#: auto`` until the job has seen failures of its own.
NODE_MTBF = Setting(
    key="node_mtbf",
    flags=("--node-mtbf",),
    default=7 * 86400.0,
    spelled="7d",
    parse=lambda text: parse_duration(text, "--node-mtbf"),
    field="node_mtbf_s",
    help="the site's mean time between failures of one node (seconds, or with a unit: 12h, "
    "7d), for --persist-every auto until the job has seen failures: the job's MTBF is it "
    "divided by the node count (default 7d)",
)

# ------------------------------------------------------------------ dlrover-run: torchrun's
NPROC_PER_NODE = Setting(
    key="nproc_per_node",
    flags=_torchrun("nproc-per-node"),
    default="1",
    parse=parse_nproc,
    torchrun=different(
        "a number, auto, cpu or gpu; not xpu nor another accelerator's name, and auto counts "
        "CUDA devices only"
    ),
    help="workers per node: a number, or auto, cpu, gpu (default 1)",
)
RDZV_BACKEND = Setting(
    key="rdzv_backend",
    flags=_torchrun("rdzv-backend"),
    default="dlrover",
    field=None,
    torchrun=ignored(
        "the job master does the rendezvous (--rdzv-endpoint still says where to find or start it)"
    ),
)
RDZV_ENDPOINT = Setting(
    key="rdzv_endpoint",
    flags=_torchrun("rdzv-endpoint"),
    default="",
    torchrun=different(
        "HOST[:PORT] of the job master: with none running, the agent on HOST starts one on PORT "
        "(default 29400); under Slurm the job directory names it"
    ),
    help="HOST[:PORT]: with no job master running (a torchrun script), the agent on HOST "
    "starts one on PORT (default 29400) and the others connect to it",
)
RDZV_ID: Setting[str | None] = Setting(
    key="rdzv_id",
    flags=_torchrun("rdzv-id"),
    default=None,
    field="run_id",
    torchrun=different("default: the job master's job id (the Slurm job id), not 'none'"),
    help="run id (TORCHELASTIC_RUN_ID); default: the Slurm job id",
)
RDZV_CONF = Setting(
    key="rdzv_conf",
    flags=_torchrun("rdzv-conf"),
    default="",
    parse=parse_rdzv_conf,
    torchrun=different(
        "the keys are the job master's: join_timeout, last_call_timeout, close_timeout"
    ),
    help="KEY=VALUE,...: join_timeout, last_call_timeout, close_timeout",
)
STANDALONE = Setting(
    key="standalone",
    flags=("--standalone",),
    kind=Kind.SWITCH,
    default=False,
    torchrun=SAME,
    help="single node: run an in-process master, no Slurm needed",
)
MONITOR_INTERVAL = Setting(
    key="monitor_interval",
    flags=_torchrun("monitor-interval"),
    kind=Kind.FLOAT,
    default=0.1,
    field="monitor_interval_s",
    torchrun=SAME,
    help="seconds between checks of the workers (default 0.1)",
)
START_METHOD = Setting(
    key="start_method",
    flags=_torchrun("start-method"),
    default="spawn",
    choices=("spawn", "fork", "forkserver"),
    torchrun=ignored(
        "a worker is a process started from the script, as torchrun starts a script (torchrun "
        "uses the start method only with --run-path)"
    ),
)
EVENT_LOG_HANDLER = Setting(
    key="event_log_handler",
    flags=_torchrun("event-log-handler"),
    default="null",
    field=None,
    torchrun=ignored("events go to <job dir>/events.jsonl"),
)
ROLE = Setting(
    key="role",
    flags=("--role",),
    default="default",
    torchrun=SAME,
    help="role of the workers (default: default)",
)
MODULE = Setting(
    key="module",
    flags=("-m", "--module"),
    kind=Kind.SWITCH,
    default=False,
    torchrun=SAME,
    help="run the script as a module, like python -m",
)
NO_PYTHON = Setting(
    key="no_python",
    flags=_torchrun("no-python"),
    kind=Kind.SWITCH,
    default=False,
    torchrun=SAME,
    help="run the script as an executable, without prepending python",
)
RUN_PATH = Setting(
    key="run_path",
    flags=_torchrun("run-path"),
    kind=Kind.SWITCH,
    default=False,
    field=None,
    torchrun=ignored(
        "each worker runs the script in a process of its own, as without --run-path: flash "
        "checkpoints and recovery need one per worker"
    ),
)
LOG_DIR: Setting[str | None] = Setting(
    key="log_dir",
    flags=_torchrun("log-dir"),
    default=None,
    torchrun=different(
        "default: <job dir>/logs/<node>, not a temporary directory; each rendezvous round has "
        "a round<N> directory in it"
    ),
    help="directory for per-rank stdout/stderr logs",
)
REDIRECTS = Setting(
    key="redirects",
    flags=("-r", "--redirects"),
    default="0",
    torchrun=SAME,
    help="redirect std streams of workers into log files: 0 none, 1 stdout, "
    "2 stderr, 3 both; or per rank, e.g. 0:1,1:2",
)
TEE = Setting(
    key="tee",
    flags=("-t", "--tee"),
    default="0",
    torchrun=SAME,
    help="copy std streams to log files and the console (same values)",
)
LOCAL_RANKS_FILTER = Setting(
    key="local_ranks_filter",
    flags=_torchrun("local-ranks-filter"),
    default="",
    torchrun=SAME,
    help="only show these local ranks on the console, e.g. 0,1",
)


def _duplicate(stream: str) -> Setting[str]:
    """torchrun's ``--duplicate-<stream>-filters``: the tee'd lines that match, in one file."""
    return Setting(
        key=f"duplicate_{stream}_filters",
        flags=_torchrun(f"duplicate-{stream}-filters"),
        default="",
        field=None,
        metavar="TEXT,...",
        torchrun=ignored(
            f"no filtered_{stream}.log is written; grep the {stream}.log files under --log-dir"
        ),
    )


DUPLICATE_STDOUT_FILTERS = _duplicate("stdout")
DUPLICATE_STDERR_FILTERS = _duplicate("stderr")
NODE_RANK = Setting(
    key="node_rank",
    flags=_torchrun("node-rank"),
    kind=Kind.INT,
    default=-1,
    field=None,
    torchrun=ignored("the job master assigns node ranks (in topology order)"),
)
MASTER_ADDR: Setting[str | None] = Setting(
    key="master_addr",
    flags=_torchrun("master-addr"),
    default=None,
    field=None,
    torchrun=ignored("MASTER_ADDR is node rank 0's address, chosen by the job master each round"),
)
MASTER_PORT: Setting[int | None] = Setting(
    key="master_port",
    flags=_torchrun("master-port"),
    kind=Kind.INT,
    default=None,
    field=None,
    torchrun=ignored(
        "MASTER_PORT is fresh each round, so a restart never dials the previous attempt's ports"
    ),
)
LOCAL_ADDR: Setting[str | None] = Setting(
    key="local_addr",
    flags=_torchrun("local-addr"),
    default=None,
    torchrun=SAME,
    help="address other nodes use to reach this one (default: host name)",
)
LOGS_SPECS: Setting[str | None] = Setting(
    key="logs_specs",
    flags=_torchrun("logs-specs"),
    default=None,
    field=None,
    torchrun=ignored(
        "the workers' logs are laid out as by torchrun's default LogsSpecs; no other is loaded"
    ),
)
SHUTDOWN_TIMEOUT = Setting(
    key="shutdown_timeout",
    flags=_torchrun("shutdown-timeout"),
    kind=Kind.INT,
    default=15,
    parse=float,
    field="shutdown_timeout_s",
    torchrun=different("default 15 s (torchrun: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s)"),
    help="seconds between SIGTERM and SIGKILL when stopping workers (default 15)",
)
NUMA_BINDING: Setting[str | None] = Setting(
    key="numa_binding",
    flags=_torchrun("numa-binding"),
    default=None,
    choices=("node", "socket", "exclusive", "core-complex"),
    field=None,
    torchrun=refused(
        "dlrover-run does not bind workers to CPUs; drop it and bind the job step instead "
        "(srun --cpu-bind=..., or numactl in a --no-python wrapper)"
    ),
)
SIGNALS_TO_HANDLE = Setting(
    key="signals_to_handle",
    flags=_torchrun("signals-to-handle"),
    default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    field=None,
    torchrun=ignored(
        "the agent stops its workers on SIGTERM, SIGINT and SIGHUP; SIGUSR1 is --requeue-by's"
    ),
)

VIRTUAL_LOCAL_RANK = Setting(
    key="virtual_local_rank",
    flags=_torchrun("virtual-local-rank"),
    kind=Kind.SWITCH,
    default=False,
    torchrun=SAME,
    help="every worker sees LOCAL_RANK=0 and only its own GPU, as device 0 "
    "(CUDA_VISIBLE_DEVICES: its entry of the agent's list, else its local rank)",
)

# ------------------------------------------------------------------ dlrover-run: its own
MASTER: Setting[str | None] = Setting(
    key="master",
    flags=("--master",),
    default=None,
    parse=lambda text: parse_host_port(text, flag="--master") if text else None,
    help=f"job master HOST:PORT (default ${PREFIX}MASTER, else discovered from the job "
    "directory under Slurm)",
)
NETWORK_CHECK = Setting(
    key="network_check",
    flags=("--network-check",),
    kind=Kind.SWITCH,
    default=False,
    help="pairwise network check before training and before each restart",
)
EXCLUDE_STRAGGLER = Setting(
    key="exclude_straggler",
    flags=("--exclude-straggler",),
    kind=Kind.SWITCH,
    default=False,
    help="exclude stragglers: with --network-check, a node whose check takes over 2x the "
    "median and 25 ms more; and a runtime straggler's node (straggler_detected) is swapped "
    "out at the next checkpoint always, not only when a spare waits or the others are enough",
)
#: ``--reconnect-timeout``: how long an agent whose master connection dropped keeps trying to
#: reconnect (its workers train on meanwhile) before it stops them and exits.
RECONNECT_TIMEOUT = Setting(
    key="reconnect_timeout",
    flags=("--reconnect-timeout",),
    kind=Kind.FLOAT,
    default=120.0,
    field="reconnect_timeout_s",
    help="seconds to keep reconnecting to a lost master while the workers train on, "
    "before stopping them (default 120)",
)
#: ``--hang-timeout auto`` (the default): a bound learned from the job's own step times
#: (:data:`dlrover_hpc.values.HANG_AUTO`); a number of seconds is a fixed bound; 0 is off.
HANG_TIMEOUT = Setting(
    key="hang_timeout",
    flags=("--hang-timeout",),
    default=HANG_AUTO,
    spelled="auto",
    parse=parse_hang_timeout,
    field="hang_timeout_s",
    help="how long no rank may progress before the job's stacks are dumped to "
    "<job dir>/hangs/ and the workers restart: auto (learned from the step times: about "
    "2x their p99 + 10 s, at least 30 s, with a longer bound for warm-up, checkpoints, "
    "evaluation and a data loader's start), a fixed number of seconds, or 0: off "
    "(default auto)",
)
#: ``--straggler-factor``: a rank whose compute per step (data, forward, backward, optimizer)
#: takes this many times its peers' mean while they wait for it, over 12 of its steps, is a
#: runtime straggler; 1.5x over 24 (:mod:`dlrover_hpc.master.step_slowness`); 0 is off.
STRAGGLER_FACTOR = Setting(
    key="straggler_factor",
    flags=("--straggler-factor",),
    kind=Kind.FLOAT,
    default=2.0,
    help="a rank whose compute per step (data, forward, backward, optimizer) takes this "
    "many times its peers', while they wait for it, over 12 of its steps (fewer when "
    "slower; 1.4x for the default 2, over 30 steps) is reported "
    "(straggler_detected) and its node swapped out at the next checkpoint when a spare "
    "waits or the others are enough (with --exclude-straggler: always); 0: off "
    "(default 2)",
)

#: ``--health-check PROGRAM``: the site's node check (NHC's convention), run on each node
#: before its agent joins a round (:mod:`dlrover_hpc.agent.health`); "" is none.
HEALTH_CHECK = Setting(
    key="health_check",
    flags=("--health-check",),
    default="",
    metavar="PROGRAM",
    help="the site's node health check, run on each node before it joins a round (first "
    "start, spare, replacement, relaunch, and after its workers failed): exit 0 healthy, else "
    "unhealthy with the first line of its output as the reason (NHC's convention); an "
    "unhealthy node is excluded and drained (node_unhealthy) and its agent exits; "
    "arguments may follow in one quoted string (default: none)",
)
HEALTH_CHECK_TIMEOUT = Setting(
    key="health_check_timeout",
    flags=("--health-check-timeout",),
    kind=Kind.FLOAT,
    default=60.0,
    field="health_check_timeout_s",
    help="seconds the --health-check program may run before it is killed and the node counts "
    "as unhealthy (default 60)",
)

LOCAL_CKPT_DIR = Setting(
    key="local_ckpt_dir",
    flags=("--local-ckpt-dir",),
    default="",
    metavar="DIR",
    env_name=environ.LOCAL_CKPT_DIR,
    help="a node-local checkpoint tier (an absolute path on the node's own disk, NVMe on real "
    "clusters): each persisted step is written there first, then to the shared checkpoint "
    "directory, and a restore (a relaunched agent, a requeue on the same node) reads it there "
    "instead of the shared file system; keeps the checkpointer's keep_last steps (default 2), "
    "removed when the job ends for good; a failing or full local disk falls back to the "
    "shared directory (checkpoint_local_tier_failed) (default: none)",
)


def _off(name: str, *, what: str, cost: str) -> Setting[bool]:
    """The off switch of something dlrover-run puts into its workers (``--no-<name>``;
    :mod:`dlrover_hpc.injections`): ``what`` the workers do with it on, what turning it off
    ``cost``\\ s."""
    key = "no_" + name
    return Setting(
        key=key,
        flags=("--no-" + name.replace("_", "-"),),
        kind=Kind.SWITCH,
        default=False,
        field=None,
        help=f"by default dlrover-run's workers {what}; this turns it off, which costs: {cost} "
        f"(also ${PREFIX}{key.upper()})",
    )


NO_PREWARM = _off(
    "prewarm",
    what="are forked from a pre-warmed interpreter that imported torch once per node",
    cost="each worker start pays Python's start-up and `import torch` (about 1-2 s of CPU per "
    "worker here, more on a busy node): every restart takes that much longer",
)
NO_WORKER_HOOKS = _off(
    "worker_hooks",
    what="run progress hooks (optimizer steps, eval() and data-loader sections, SIGUSR2 stack "
    "dumps)",
    cost="hang detection sees only explicit progress (dlrover_hpc.progress.step, flash "
    "checkpoint saves) and CPU use: no learned bound from the step times, no straggler "
    "detection, no eval/data sections",
)
NO_USR1_HOLD = _off(
    "usr1_hold",
    what="block Slurm's USR1 (the master saves and requeues at a time limit)",
    cost="a USR1 from Slurm (--signal) reaches the script as under torchrun: a script without "
    "a handler dies of it",
)
NO_SLURM_ENV_REWRITE = _off(
    "slurm_env_rewrite",
    what="see SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and SLURM_NODEID rewritten to their rank",
    cost="a framework that reads SLURM_* (Lightning's SLURMEnvironment) sees the agent's task, "
    "as under torchrun, and may disagree with RANK",
)
NO_GC_HANDLING = _off(
    "gc_handling",
    what="freeze their long-lived objects (gc.freeze) for in-process recovery, before the "
    "first attempt and after each collection",
    cost="a round change walks every object in a full collection (about 0.16 s here with torch "
    "imported); the attempt's garbage is still collected",
)
OFF_SWITCHES = (NO_PREWARM, NO_WORKER_HOOKS, NO_USR1_HOLD, NO_SLURM_ENV_REWRITE, NO_GC_HANDLING)
TRANSPARENT = Setting(
    key="transparent",
    flags=("--transparent",),
    kind=Kind.SWITCH,
    default=False,
    field=None,
    help="start workers exactly as torchrun would: every --no-* switch above at once "
    f"(recovery, flash checkpoints and the master still work); also ${PREFIX}TRANSPARENT",
)

# ------------------------------------------------------------------ dlrover-hpc master's own
HOST = Setting(
    key="host",
    flags=("--host",),
    default="0.0.0.0",
    help="address to listen on (default 0.0.0.0)",
)
PORT = Setting(
    key="port",
    flags=("--port",),
    kind=Kind.INT,
    default=0,
    help="port to listen on; 0 picks a free one (default 0)",
)
TOPOLOGY: Setting[str | None] = Setting(
    key="topology",
    flags=("--topology",),
    default=None,
    help="switch topology file (Slurm topology.conf, block.conf or ASW PSW HOST list)",
)
DRAIN = Setting(
    key="drain",
    flags=("--drain",),
    default=DrainMode.SCONTROL,
    choices=tuple(mode.value for mode in DrainMode),
    parse=DrainMode.parse,
    help="what to do with a faulty node (default scontrol; falls back to "
    "quarantine when Slurm refuses)",
)
HEARTBEAT_TIMEOUT = Setting(
    key="heartbeat_timeout",
    flags=("--heartbeat-timeout",),
    kind=Kind.FLOAT,
    default=15.0,
    field="heartbeat_timeout_s",
    help="seconds without a heartbeat before an agent counts as lost",
)
LAST_CALL = Setting(
    key="last_call",
    flags=("--last-call",),
    kind=Kind.FLOAT,
    default=3.0,
    field="last_call_s",
    help="seconds to wait for more nodes once MIN have joined (default 3)",
)
#: ``--scale-up-wait``: how long a scale-up (a node returning to a job running below MAX) may
#: wait for the next checkpoint, so that the restart that takes the node in redoes no step.
SCALE_UP_WAIT = Setting(
    key="scale_up_wait",
    flags=("--scale-up-wait",),
    kind=Kind.FLOAT,
    default=300.0,
    field="scale_up_wait_s",
    help="seconds a node that could join the running job (back from a fault, or a "
    "replacement) may wait for the job's next checkpoint, so that the restart taking it "
    "in redoes no step; a fault meanwhile takes it in at once. 0: at once (default 300)",
)
NETCHECK_TIMEOUT = Setting(
    key="netcheck_timeout",
    flags=("--netcheck-timeout",),
    kind=Kind.FLOAT,
    default=30.0,
    field="netcheck_timeout_s",
    help="seconds a network-check probe may take before its group counts as failed",
)
REPLACEMENT_SBATCH: Setting[str | None] = Setting(
    key="replacement_sbatch",
    flags=("--replacement-sbatch",),
    default=None,
    parse=lambda text: None if text in ("", "off") else text,
    help="sbatch template of replacement jobs (sbatch/replacement.sbatch; train.sbatch "
    "sets it); 'off' disables replacement jobs",
)
MIN_NODES_TIMEOUT = Setting(
    key="min_nodes_timeout",
    flags=("--min-nodes-timeout",),
    kind=Kind.FLOAT,
    default=300.0,
    field="min_nodes_timeout_s",
    help="seconds below MIN nodes before the job is requeued (default 300)",
)
#: The master's ``--hang-timeout``: 0 takes the agents' (their own setting above).
MASTER_HANG_TIMEOUT = Setting(
    key="hang_timeout",
    flags=("--hang-timeout",),
    default=0.0,
    parse=parse_hang_timeout,
    field="hang_timeout_s",
    env_name=PREFIX + "MASTER_HANG_TIMEOUT",
    help="auto (learned from the step times), seconds with no progress on any rank before "
    "the stacks are dumped and the workers restart (default 0: the agents' --hang-timeout; "
    f"${PREFIX}MASTER_HANG_TIMEOUT)",
)
METRICS_PORT = Setting(
    key="metrics_port",
    flags=("--metrics-port",),
    kind=Kind.INT,
    default=0,
    help="serve Prometheus metrics on http://HOST:PORT/metrics (default 0: off; also "
    f"${PREFIX}METRICS_PORT)",
)
REQUEUE = Setting(
    key="requeue",
    flags=("--requeue",),
    kind=Kind.ON_OFF,
    default=True,
    help="under Slurm, requeue the job when it stays below MIN nodes (default on)",
)
#: ``--crash-loop-rounds`` (issue 48): failed rounds in a row without progress that stop the job.
CRASH_LOOP_ROUNDS = Setting(
    key="crash_loop_rounds",
    flags=("--crash-loop-rounds",),
    kind=Kind.INT,
    default=3,
    help={
        Command.MASTER: "stop the job (exit 3) after this many rounds in a row end in a failure "
        "of any kind (software, hardware, a peer, a node lost, a hang) with no progress: no "
        "newer checkpoint step committed or held in memory by every rank, no training step "
        "beyond the job's best; a node that failed first in 2 of the last this-many rounds is "
        "excluded. 0: off (default 3)",
        Command.RUN: "the crash-loop guard of an in-process master (--standalone, or the "
        "embedded master of a job with no master step): stop the job (exit 3) after this many "
        "failed rounds in a row with no progress (no newer checkpoint step, no step beyond the "
        "job's best). 0: off (default 3); train.sbatch gives its master the same value",
    },
)
MAX_CONTINUATIONS = Setting(
    key="max_continuations",
    flags=("--max-continuations",),
    kind=Kind.INT,
    default=5,
    help="at a time limit or preemption, save and continue the job in a new run "
    "(requeue, else resubmission) at most this many times (default 5; 0: never)",
)
STOP_LEAD = Setting(
    key="stop_lead",
    flags=("--stop-lead",),
    kind=Kind.FLOAT,
    default=90.0,
    field="stop_lead_s",
    help="seconds before the time limit at which the job saves and stops on its own, "
    "when no --signal came first (default 90; 0: off)",
)

# ------------------------------------------------------------------ dlrover-hpc launch's
BLOCKLIST: Setting[str | None] = Setting(
    key="blocklist",
    flags=("--blocklist",),
    default=None,
    help="blocklist shared by jobs",
)
KNOWN_HOSTS: Setting[str | None] = Setting(
    key="known_hosts",
    flags=("--known-hosts",),
    default=None,
    help="known_hosts file",
)
SSH_CONFIG: Setting[str | None] = Setting(
    key="ssh_config",
    flags=("--ssh-config",),
    default=None,
    help="OpenSSH client config file",
)
SSH_PORT: Setting[int | None] = Setting(key="ssh_port", kind=Kind.INT, default=None)
CONNECT_TIMEOUT = Setting(key="connect_timeout", kind=Kind.FLOAT, default=10.0)
REMOTE_PYTHON: Setting[str | None] = Setting(key="remote_python", default=None)
MASTER_OPTS = Setting(key="master_opts", default="")

#: Each command's settings in the order of its flags (of its ``--help`` and ``config show``).
_RUN = (
    NNODES, NPROC_PER_NODE, RDZV_BACKEND, RDZV_ENDPOINT, RDZV_ID, RDZV_CONF, STANDALONE,
    MAX_RESTARTS, MONITOR_INTERVAL, START_METHOD, EVENT_LOG_HANDLER, ROLE, MODULE, NO_PYTHON,
    RUN_PATH, LOG_DIR, REDIRECTS, TEE, LOCAL_RANKS_FILTER, DUPLICATE_STDOUT_FILTERS,
    DUPLICATE_STDERR_FILTERS, NODE_RANK, MASTER_ADDR, MASTER_PORT, LOCAL_ADDR, LOGS_SPECS,
    NUMA_BINDING, SIGNALS_TO_HANDLE, SHUTDOWN_TIMEOUT, VIRTUAL_LOCAL_RANK,
    MASTER, NETWORK_CHECK, EXCLUDE_STRAGGLER, NODE_UNIT, SEGMENT, LINK_TIMEOUT, RECONNECT_TIMEOUT,
    HANG_TIMEOUT, STRAGGLER_FACTOR, REQUEUE_BY, *OFF_SWITCHES, TRANSPARENT, JOB_DIR, CONFIG,
    HEALTH_CHECK, HEALTH_CHECK_TIMEOUT, CRASH_LOOP_ROUNDS, PERSIST_EVERY, NODE_MTBF,
    LOCAL_CKPT_DIR,
)  # fmt: skip
_MASTER = (
    HOST, PORT, NNODES, NODE_UNIT, SEGMENT, TOPOLOGY, DRAIN, JOB_DIR, MAX_RESTARTS,
    HEARTBEAT_TIMEOUT, LINK_TIMEOUT, LAST_CALL, SCALE_UP_WAIT, NETCHECK_TIMEOUT, REPLACEMENT_SBATCH,
    MIN_NODES_TIMEOUT, MASTER_HANG_TIMEOUT, METRICS_PORT, REQUEUE, MAX_CONTINUATIONS,
    STOP_LEAD, REQUEUE_BY, CRASH_LOOP_ROUNDS, PERSIST_EVERY, NODE_MTBF, CONFIG,
)  # fmt: skip
_LAUNCH = (
    BLOCKLIST, KNOWN_HOSTS, SSH_CONFIG, SSH_PORT, CONNECT_TIMEOUT, REMOTE_PYTHON, MASTER_OPTS,
)  # fmt: skip
BY_COMMAND: Mapping[Command, tuple[Setting[Any], ...]] = {
    Command.RUN: _RUN,
    Command.MASTER: _MASTER,
    Command.LAUNCH: _LAUNCH,
    Command.FILES: (SITE_CONFIG,),
}
#: Every declaration, once.
ALL: tuple[Setting[Any], ...] = tuple(
    dict.fromkeys(s for settings in BY_COMMAND.values() for s in settings)
)


def commands_of(setting: Setting[Any]) -> tuple[Command, ...]:
    """The commands that take ``setting``."""
    return tuple(c for c, settings in BY_COMMAND.items() if setting in settings)


def shared(first: Command, second: Command) -> tuple[Setting[Any], ...]:
    """The settings both commands take (one declaration: the same flag, default, variable)."""
    return tuple(s for s in BY_COMMAND[first] if s in BY_COMMAND[second])


def by_key(command: Command) -> dict[str, Setting[Any]]:
    return {s.key: s for s in BY_COMMAND[command]}
