"""``dlrover-run`` flags: every torchrun flag with torchrun's meaning, plus dlrover-hpc's own."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from dlrover_hpc import injections
from dlrover_hpc.cli import site_config
from dlrover_hpc.cli.commands import master_parser
from dlrover_hpc.cli.parser import Parser
from dlrover_hpc.cli.site_config import ConfigFiles, Defaults
from dlrover_hpc.config import (
    DEFAULT_HANG_TIMEOUT,
    DEFAULT_LINK_TIMEOUT_S,
    DEFAULT_RECONNECT_TIMEOUT_S,
    DEFAULT_STRAGGLER_FACTOR,
    NodeRange,
    RequeueBy,
    RunConfig,
    parse_hang_timeout,
    parse_host_port,
    parse_nproc,
    parse_rdzv_conf,
)
from dlrover_hpc.errors import ConfigError

DESCRIPTION = """\
Start one dlrover-hpc agent on this node: join the job master's rendezvous, spawn
--nproc-per-node workers with torchrun's environment, supervise and restart them, and host
the node's flash-checkpoint saver.  Accepts every torchrun flag.

examples:
  dlrover-run --standalone --nproc-per-node=2 train.py --steps 100
  srun dlrover-run --nnodes=3:4 --nproc-per-node=2 --max-restarts=3 train.py
"""


def _both(name: str) -> list[str]:
    """torchrun accepts both --nproc-per-node and --nproc_per_node spellings."""
    dashed = f"--{name}"
    under = dashed[:2] + dashed[2:].replace("-", "_")
    return [dashed] if under == dashed else [dashed, under]


def build_parser(defaults: Defaults | None = None) -> argparse.ArgumentParser:
    """dlrover-run's parser; ``defaults``: the flags' defaults (environment only when None)."""
    defaults = defaults or Defaults("run")
    p = Parser(
        prog="dlrover-run",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    t = p.add_argument_group("torchrun flags (same meaning as torchrun's)")
    t.add_argument(
        "--nnodes",
        default=defaults.value("nnodes", "1:1"),
        help="number of nodes, or MIN:MAX for an elastic job (default 1:1)",
    )
    t.add_argument(
        *_both("nproc-per-node"),
        dest="nproc_per_node",
        default=defaults.value("nproc_per_node", "1"),
        help="workers per node: a number, or auto, cpu, gpu (default 1)",
    )
    t.add_argument(
        *_both("rdzv-backend"),
        dest="rdzv_backend",
        default=defaults.value("rdzv_backend", "dlrover"),
        help="accepted for torchrun compatibility; the job master does rendezvous",
    )
    t.add_argument(
        *_both("rdzv-endpoint"),
        dest="rdzv_endpoint",
        default=defaults.value("rdzv_endpoint", ""),
        help="HOST[:PORT]: with no job master running (a torchrun script), the agent on HOST "
        "starts one on PORT (default 29400) and the others connect to it",
    )
    t.add_argument(
        *_both("rdzv-id"),
        dest="rdzv_id",
        default=defaults.value("rdzv_id", None),
        help="run id (TORCHELASTIC_RUN_ID); default: the Slurm job id",
    )
    t.add_argument(
        *_both("rdzv-conf"),
        dest="rdzv_conf",
        default=defaults.value("rdzv_conf", ""),
        help="KEY=VALUE,...: join_timeout, last_call_timeout, close_timeout",
    )
    t.add_argument(
        "--standalone",
        action="store_true",
        default=defaults.switch("standalone", False),
        help="single node: run an in-process master, no Slurm needed",
    )
    t.add_argument(
        *_both("max-restarts"),
        dest="max_restarts",
        type=int,
        default=defaults.value("max_restarts", "3"),
        help="worker-group restarts allowed for the whole job (counted per job, "
        "not per agent as torchrun does; default 3)",
    )
    t.add_argument(
        *_both("monitor-interval"),
        dest="monitor_interval",
        type=float,
        default=defaults.value("monitor_interval", "0.1"),
        help="seconds between checks of the workers (default 0.1)",
    )
    t.add_argument(
        *_both("start-method"),
        dest="start_method",
        default=defaults.value("start_method", "spawn"),
        choices=["spawn", "fork", "forkserver"],
        help="how workers are started",
    )
    t.add_argument(
        *_both("event-log-handler"),
        dest="event_log_handler",
        default=defaults.value("event_log_handler", "null"),
        help="accepted for torchrun compatibility; events go to events.jsonl",
    )
    t.add_argument(
        "--role",
        default=defaults.value("role", "default"),
        help="role of the workers (default: default)",
    )
    t.add_argument(
        "-m",
        "--module",
        action="store_true",
        default=defaults.switch("module", False),
        help="run the script as a module, like python -m",
    )
    t.add_argument(
        *_both("no-python"),
        dest="no_python",
        action="store_true",
        default=defaults.switch("no_python", False),
        help="run the script as an executable, without prepending python",
    )
    t.add_argument(
        *_both("run-path"),
        dest="run_path",
        action="store_true",
        default=defaults.switch("run_path", False),
        help="accepted for torchrun compatibility (runs in a worker process)",
    )
    t.add_argument(
        *_both("log-dir"),
        dest="log_dir",
        default=defaults.value("log_dir", None),
        help="directory for per-rank stdout/stderr logs",
    )
    t.add_argument(
        "-r",
        "--redirects",
        default=defaults.value("redirects", "0"),
        help="redirect std streams of workers into log files: 0 none, 1 stdout, "
        "2 stderr, 3 both; or per rank, e.g. 0:1,1:2",
    )
    t.add_argument(
        "-t",
        "--tee",
        default=defaults.value("tee", "0"),
        help="copy std streams to log files and the console (same values)",
    )
    t.add_argument(
        *_both("local-ranks-filter"),
        dest="local_ranks_filter",
        default=defaults.value("local_ranks_filter", ""),
        help="only show these local ranks on the console, e.g. 0,1",
    )
    t.add_argument(
        *_both("node-rank"),
        dest="node_rank",
        type=int,
        default=defaults.value("node_rank", "-1"),
        help="ignored: the master assigns node ranks (topology order)",
    )
    t.add_argument(
        *_both("master-addr"),
        dest="master_addr",
        default=defaults.value("master_addr", None),
        help="ignored: MASTER_ADDR is node rank 0's address, chosen per round",
    )
    t.add_argument(
        *_both("master-port"),
        dest="master_port",
        type=int,
        default=defaults.value("master_port", None),
        help="ignored: MASTER_PORT is fresh for every round so restarts never "
        "dial the previous attempt's ports",
    )
    t.add_argument(
        *_both("local-addr"),
        dest="local_addr",
        default=defaults.value("local_addr", None),
        help="address other nodes use to reach this one (default: host name)",
    )
    t.add_argument(
        *_both("logs-specs"),
        dest="logs_specs",
        default=defaults.value("logs_specs", None),
        help="accepted for torchrun compatibility",
    )
    t.add_argument(
        *_both("shutdown-timeout"),
        dest="shutdown_timeout",
        type=int,
        default=defaults.value("shutdown_timeout", "15"),
        help="seconds between SIGTERM and SIGKILL when stopping workers (default 15)",
    )
    t.add_argument(
        *_both("signals-to-handle"),
        dest="signals_to_handle",
        default=defaults.value("signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"),
        help="signals forwarded to the workers",
    )
    d = p.add_argument_group("dlrover-hpc flags")
    d.add_argument(
        "--master",
        default=defaults.value("master", None),
        help="job master HOST:PORT (default $DLROVER_HPC_MASTER, else discovered "
        "from the job directory under Slurm)",
    )
    d.add_argument(
        "--network-check",
        action="store_true",
        default=defaults.switch("network_check", False),
        help="pairwise network check before training and before each restart",
    )
    d.add_argument(
        "--exclude-straggler",
        action="store_true",
        default=defaults.switch("exclude_straggler", False),
        help="with --network-check: exclude a straggler (check time > 2x median)",
    )
    d.add_argument(
        "--node-unit",
        type=int,
        default=defaults.value("node_unit", "1"),
        help="admit nodes only in multiples of N (default 1)",
    )
    d.add_argument(
        "--link-timeout",
        type=float,
        default=defaults.value("link_timeout", f"{DEFAULT_LINK_TIMEOUT_S:g}"),
        help="seconds of silence before the connection to the master fails (TCP keepalive "
        f"and TCP_USER_TIMEOUT; default {DEFAULT_LINK_TIMEOUT_S:g})",
    )
    d.add_argument(
        "--reconnect-timeout",
        type=float,
        default=defaults.value("reconnect_timeout", f"{DEFAULT_RECONNECT_TIMEOUT_S:g}"),
        help="seconds to keep reconnecting to a lost master while the workers train on, "
        f"before stopping them (default {DEFAULT_RECONNECT_TIMEOUT_S:g})",
    )
    d.add_argument(
        "--hang-timeout",
        default=defaults.value("hang_timeout", DEFAULT_HANG_TIMEOUT),
        help="how long no rank may progress before the job's stacks are dumped to "
        "<job dir>/hangs/ and the workers restart: auto (learned from the step times: about "
        "2x their p99 + 10 s, at least 30 s, with a longer bound for warm-up, checkpoints, "
        "evaluation and a data loader's start), a fixed number of seconds, or 0: off "
        f"(default {DEFAULT_HANG_TIMEOUT})",
    )
    d.add_argument(
        "--straggler-factor",
        type=float,
        default=defaults.value("straggler_factor", f"{DEFAULT_STRAGGLER_FACTOR:g}"),
        help="a rank whose compute per step (data, forward, backward, optimizer) takes this "
        "many times its peers' median, while they wait for it, for 20 s is reported "
        "(straggler_detected) and its node swapped out at the next checkpoint when a spare "
        "waits or the others are enough (with --exclude-straggler: always); 0: off "
        f"(default {DEFAULT_STRAGGLER_FACTOR:g})",
    )
    d.add_argument(
        "--requeue-by",
        choices=[by.value for by in RequeueBy],
        default=defaults.value("requeue_by", RequeueBy.DLROVER_HPC.value),
        help="who continues the job at a time limit or preemption: dlrover-hpc (default: the "
        "master saves at a step boundary and requeues; Slurm's USR1 never reaches a worker, "
        "so a framework's own requeue does not run as well) or framework (the agents pass USR1 "
        "on to the workers, the master continues nothing: Lightning's auto-requeue or the "
        "script's own handler requeues); give the master the same value",
    )
    for inj in injections.ALL:
        d.add_argument(
            inj.flag,
            action="store_true",
            default=defaults.switch(inj.key, False),
            help=f"by default dlrover-run's workers {inj.what}; this turns it off, which "
            f"costs: {inj.cost} (also ${inj.env})",
        )
    d.add_argument(
        "--transparent",
        action="store_true",
        default=defaults.switch("transparent", False),
        help="start workers exactly as torchrun would: every --no-* switch above at once "
        "(recovery, flash checkpoints and the master still work); "
        f"also ${injections.TRANSPARENT_ENV}",
    )
    d.add_argument(
        "--job-dir",
        default=defaults.value("job_dir", None),
        help="job directory (default $SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID)",
    )
    d.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML file of flag defaults ([run] section), over the user's and the site's "
        f"(default ${site_config.CONFIG_ENV}); see 'dlrover-hpc config show'",
    )
    p.add_argument("training_script", help="the training script (or module with -m)")
    p.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments of the training script"
    )
    p.set_defaults(origins=defaults.origins)  # where each default came from, for error messages
    return p


def section_parser(section: str, files: ConfigFiles | None = None) -> argparse.ArgumentParser:
    """The parser whose flags a section of the TOML files sets, with the files' defaults."""
    defaults = Defaults(section, files)
    return build_parser(defaults) if section == "run" else master_parser(defaults)


def section_parsers() -> dict[str, argparse.ArgumentParser]:
    return {section: section_parser(section) for section in site_config.COMMANDS}


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """Parsed flags as a :class:`RunConfig`; raises ConfigError (exit 2) naming the flag and fix."""
    hang_timeout_s = parse_hang_timeout(str(args.hang_timeout))
    if args.standalone and args.rdzv_endpoint:
        raise ConfigError(
            f"--standalone runs its own in-process master on this node; drop "
            f"--rdzv-endpoint={args.rdzv_endpoint}, or drop --standalone for a multi-node job"
        )
    return RunConfig(
        nnodes=NodeRange.parse(args.nnodes),
        nproc_per_node=parse_nproc(str(args.nproc_per_node)),
        standalone=args.standalone,
        master=parse_host_port(args.master, flag="--master") if args.master else None,
        max_restarts=args.max_restarts,
        monitor_interval_s=args.monitor_interval,
        start_method=args.start_method,
        role=args.role,
        module=args.module,
        no_python=args.no_python,
        log_dir=args.log_dir,
        redirects=args.redirects,
        tee=args.tee,
        local_ranks_filter=args.local_ranks_filter,
        local_addr=args.local_addr,
        shutdown_timeout_s=float(args.shutdown_timeout),
        network_check=args.network_check,
        exclude_straggler=args.exclude_straggler,
        node_unit=args.node_unit,
        job_dir=args.job_dir,
        run_id=args.rdzv_id,
        rdzv_conf=parse_rdzv_conf(args.rdzv_conf),
        training_script=args.training_script,
        training_script_args=tuple(args.training_script_args),
        link_timeout_s=args.link_timeout,
        reconnect_timeout_s=args.reconnect_timeout,
        hang_timeout_s=hang_timeout_s,
        straggler_factor=args.straggler_factor,
        requeue_by=RequeueBy.parse(args.requeue_by),
        rdzv_endpoint=args.rdzv_endpoint,
        off=frozenset(i.name for i in injections.ALL if args.transparent or getattr(args, i.key)),
    )


def check_script(config: RunConfig) -> None:
    """A missing script would fail every worker and spend the restarts: say so before starting."""
    script = config.training_script
    if config.module:
        return  # a module is found by the worker's Python (its sys.path), not here
    if config.no_python:
        found = os.path.isfile(script) if os.sep in script else shutil.which(script) is not None
        if not found:
            raise ConfigError(
                f"{script}: no such program (--no-python runs the script as an executable); "
                "check the name, or drop --no-python to run a Python script"
            )
        return
    if not os.path.isfile(script):
        where = "" if os.path.isabs(script) else f" in {os.getcwd()}"
        raise ConfigError(
            f"training script {script}: no such file{where}; check the path, or run a module "
            "with -m (e.g. dlrover-run -m pkg.train)"
        )


def parse_args(argv: Sequence[str], *, config: str | None = None) -> argparse.Namespace:
    """The flags over ``DLROVER_HPC_<FLAG>`` over the TOML files (exit 2 on an error).

    The first pass finds ``--config`` (the training script's own flags are not dlrover-run's);
    the second parses again with the files' defaults, once every file has been checked.
    ``config``: the file when the flags name none (``dlrover-hpc config get``'s).
    """
    first = build_parser()
    args = first.parse_args(argv)
    try:
        files = site_config.load(
            args.config or config, {"run": first, "master": section_parser("master")}
        )
    except ConfigError as exc:
        first.exit(2, f"dlrover-run: error: {exc}\n")
    return section_parser("run", files).parse_args(argv)


def parse(argv: Sequence[str] | None = None) -> RunConfig:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = config_from_args(args)
        check_script(config)
    except ConfigError as exc:
        print(f"dlrover-run: error: {site_config.attribute(str(exc), args)}", file=sys.stderr)
        raise SystemExit(2) from None
    return config
