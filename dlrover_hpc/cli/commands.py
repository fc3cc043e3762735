"""``dlrover-hpc master``, ``drain`` and ``status``: their flags, checks and calls."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
from pathlib import Path

from dlrover_hpc import jobdir, settings, topology
from dlrover_hpc.cli import site_config
from dlrover_hpc.cli.parser import Parser
from dlrover_hpc.cli.site_config import Defaults
from dlrover_hpc.config import MasterConfig, env_default
from dlrover_hpc.errors import ConfigError, DlroverHpcError, UsageError
from dlrover_hpc.jobdir import default_job_dir
from dlrover_hpc.settings import Command


def register_master(sub: argparse._SubParsersAction, defaults: Defaults | None = None) -> None:
    """``defaults``: the flags' defaults (environment only when None)."""
    defaults = defaults or Defaults(Command.MASTER.value)
    p = sub.add_parser(
        "master",
        help="run the job master (step 0 of a job)",
        description="Run the job master: rendezvous, node ranks in topology order, failure "
        "policy, network checks, drain/quarantine and replacements. Every flag can also come "
        f"from {settings.PREFIX}<FLAG> (e.g. {settings.NNODES.env}=4:4), and from the [master] "
        "section of the TOML files (see 'dlrover-hpc config show master').",
    )
    for setting in settings.BY_COMMAND[Command.MASTER]:
        defaults.add(p, setting)
    # origins: where each default came from, for error messages
    p.set_defaults(func=_master, origins=defaults.origins)


def master_parser(defaults: Defaults | None = None) -> argparse.ArgumentParser:
    """The ``master`` subcommand's parser on its own (its flags, for the TOML files)."""
    sub = Parser(prog="dlrover-hpc", allow_abbrev=False).add_subparsers(dest="command")
    register_master(sub, defaults)
    return sub.choices["master"]


def master_config(args: argparse.Namespace) -> MasterConfig:
    """Parsed flags as a :class:`MasterConfig`; a ConfigError names the flag, and the file and
    line or the variable its value came from."""
    try:
        return _master_config(args)
    except ConfigError as exc:
        raise ConfigError(site_config.attribute(str(exc), args)) from None


def _master_config(args: argparse.Namespace) -> MasterConfig:
    values = site_config.config_values(args, Command.MASTER)
    return MasterConfig(
        **values | {"job_dir": args.job_dir or default_job_dir()},
        job_id=os.environ.get("SLURM_JOB_ID", "standalone"),
    )


def check_listen(host: str, port: int, flag: str = "--port") -> None:
    """Fail on a bad --host/--port now, with the flag's name, not later inside the server."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(
            f"--host={host}: cannot resolve it ({exc.strerror}); give an address or host name "
            "of this node, or 0.0.0.0 for all"
        ) from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            sock.bind(address)
        except OSError as exc:
            fix = {
                errno.EADDRINUSE: f"pick another {flag}"
                + (", or --port=0 for a free one" if flag == "--port" else ""),
                errno.EACCES: f"ports below 1024 need root: pick another {flag}"
                + (", or --port=0" if flag == "--port" else ""),
                errno.EADDRNOTAVAIL: f"{host} is not an address of this node: use one of its "
                "addresses or 0.0.0.0",
            }.get(exc.errno or 0, "check --host and --port")
            raise ConfigError(
                f"--host={host} {flag}={port}: cannot listen there ({exc.strerror}); {fix}"
            ) from None


def _master(args: argparse.Namespace) -> int:
    from dlrover_hpc.slurm.commands import check_backend

    config = master_config(args)
    check_backend(os.environ)
    if config.topology:  # a bad file fails here (exit 2, FILE:LINE), before the job dir is made
        topology.load(config.topology)
    check_listen(config.host, config.port)
    if config.metrics_port:
        check_listen(config.host, config.metrics_port, flag="--metrics-port")
    from dlrover_hpc.master.thread import run_master

    return run_master(config)


def register_drain(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "drain",
        help="drain a node through scontrol (or print the admin command when refused)",
        description="Run scontrol update NodeName=NODE State=DRAIN Reason=... ; when Slurm "
        "refuses (not an admin), print the exact command an admin should run and exit 1.",
    )
    p.add_argument("node", help="node name")
    p.add_argument("--reason", required=True, help="why (recorded in Slurm's Reason)")
    p.set_defaults(func=_drain)


# scontrol's words when it never reached the controller, and for a node Slurm does not know.
_NO_CONTROLLER = ("Unable to contact slurm controller", "configuration source", "fatal:")
_NO_SUCH_NODE = "Invalid node name"


def _drain(args: argparse.Namespace) -> int:
    from dlrover_hpc.slurm import commands as slurm

    slurm.check_backend(os.environ)
    if not args.reason.strip():
        raise ConfigError("--reason must not be empty; say why the node is drained")
    if logging.getLogger().level > logging.DEBUG:  # the outcome is printed below, once
        logging.getLogger(slurm.__name__).setLevel(logging.ERROR)
    result = slurm.drain_node(args.node, reason=f"dlrover-hpc: {args.reason}")
    if result.ok:
        print(f"drained {args.node}: {args.reason}")
        return 0
    lines = [line.strip() for line in result.error.splitlines() if line.strip()]
    error = lines[-1] if lines else result.error
    if any(word in result.error for word in _NO_CONTROLLER):
        raise DlroverHpcError(
            f"cannot reach Slurm to drain {args.node} ({error}); run this on a node of the "
            "cluster, where 'scontrol ping' answers"
        )
    if _NO_SUCH_NODE in result.error:
        raise UsageError(
            f"Slurm has no node {args.node!r} ({error}); check the name with 'sinfo -N'"
        )
    print(f"Slurm refused to drain {args.node}: {error}")
    print(f"ask an admin to run: {result.admin_command}")
    return 1


def register_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="nodes, node ranks, states and restarts of a running job",
        description=f"Ask the job master (found through --master, ${settings.MASTER.env} or the "
        "job directory's master.json) for its node table.",
    )
    p.add_argument("--master", default=env_default(settings.MASTER), help="HOST:PORT")
    p.add_argument("--job-dir", default=env_default(settings.JOB_DIR), help="job directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--nodes",
        action="store_true",
        help="every node's row (default: every node up to 32; past that a summary: the counts "
        "by state, the slowest nodes, the stragglers' and those not running)",
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="refresh the table every SECONDS (default 2) until the job ends",
    )
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from dlrover_hpc.cli.status import print_status

    if args.watch is not None:
        if args.json:
            raise UsageError("--watch draws a live table; drop --json (or --watch)")
        if args.watch <= 0:
            raise UsageError(f"--watch={args.watch:g}: expected seconds between refreshes, > 0")
        from dlrover_hpc.cli.watch import watch_status

        return watch_status(
            master=args.master, job_dir=args.job_dir, interval_s=args.watch, nodes=args.nodes
        )
    return print_status(
        master=args.master, job_dir=args.job_dir, as_json=args.json, nodes=args.nodes
    )


def register_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="goodput of a finished or running job, and where the rest of its time went",
        description="Read the job's events.jsonl (nothing else) and print its goodput (useful "
        "steps x the median undisturbed step time / wall time from job_started to "
        "job_finished), the time lost per cause, restarts, checkpoint figures and a table "
        "per node.",
    )
    p.add_argument(
        "--job-dir",
        default=env_default(settings.JOB_DIR),
        help="job directory, or its events.jsonl",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="also draw the timeline to FILE.png")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    import json

    from dlrover_hpc.cli.status import find_job_dir
    from dlrover_hpc.report.analysis import analyze, read_events

    given = args.job_dir and Path(args.job_dir)
    if given and given.is_file():  # the log itself: report it where it lies
        log = given
    else:
        log = Path(jobdir.events_path(find_job_dir(args.job_dir)))
    report = analyze(read_events(log))
    if args.plot:
        from dlrover_hpc.report.plot import plot

        plot(report, args.plot)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        from dlrover_hpc.report.table import print_report

        print_report(report)
        if args.plot:
            print(f"timeline: {args.plot}")
    return 0


def register_stacks(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stacks",
        help="every rank's Python stack now, grouped by identical stacks",
        description="Ask the job master (found as for 'status') to read every worker's stack "
        "(py-spy, as the job's user) and print them grouped: the odd rank out stands out. "
        "The stacks are kept in the job directory's stacks/.",
    )
    p.add_argument("--master", default=env_default(settings.MASTER), help="HOST:PORT")
    p.add_argument("--job-dir", default=env_default(settings.JOB_DIR), help="job directory")
    p.set_defaults(func=_stacks)


def _stacks(args: argparse.Namespace) -> int:
    from dlrover_hpc.cli.status import print_stacks

    return print_stacks(master=args.master, job_dir=args.job_dir)
