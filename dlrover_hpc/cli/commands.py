"""Parsers of ``dlrover-hpc master``, ``drain``, ``launch`` and ``status``."""

from __future__ import annotations

import argparse

from dlrover_hpc.config import DrainMode, MasterConfig, NodeRange, env_default
from dlrover_hpc.errors import ConfigError


def register_master(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "master",
        help="run the job master (step 0 of a job)",
        description="Run the job master: rendezvous, node ranks in topology order, failure "
        "policy, network checks, drain/quarantine and replacements. Every flag can also come "
        "from DLROVER_HPC_<FLAG> (e.g. DLROVER_HPC_NNODES=4:4).",
    )
    p.add_argument(
        "--host",
        default=env_default("host", "0.0.0.0"),
        help="address to listen on (default 0.0.0.0)",
    )
    p.add_argument(
        "--port",
        type=int,
        default=int(env_default("port", "0") or 0),
        help="port to listen on; 0 picks a free one (default 0)",
    )
    p.add_argument(
        "--nnodes",
        default=env_default("nnodes", "1:1"),
        help="N or MIN:MAX nodes in the training group",
    )
    p.add_argument(
        "--node-unit",
        type=int,
        default=int(env_default("node_unit", "1") or 1),
        help="admit nodes only in multiples of N",
    )
    p.add_argument(
        "--topology",
        default=env_default("topology", None),
        help="switch topology file (Slurm topology.conf or ASW PSW HOST list)",
    )
    p.add_argument(
        "--drain",
        default=env_default("drain", "scontrol"),
        choices=[m.value for m in DrainMode],
        help="what to do with a faulty node (default scontrol; falls back to "
        "quarantine when Slurm refuses)",
    )
    p.add_argument(
        "--job-dir",
        default=env_default("job_dir", None),
        help="job directory (default $SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=int(env_default("max_restarts", "3") or 3),
        help="worker-group restarts allowed for the whole job (default 3)",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=float(env_default("heartbeat_timeout", "15") or 15),
        help="seconds without a heartbeat before an agent counts as lost",
    )
    p.add_argument(
        "--last-call",
        type=float,
        default=float(env_default("last_call", "3") or 3),
        help="seconds to wait for more nodes once MIN have joined (default 3)",
    )
    p.add_argument(
        "--netcheck-timeout",
        type=float,
        default=float(env_default("netcheck_timeout", "30") or 30),
        help="seconds a network-check probe may take before its group counts as failed",
    )
    p.add_argument(
        "--replacement-sbatch",
        default=env_default("replacement_sbatch", None),
        help="sbatch template of replacement jobs (sbatch/replacement.sbatch; train.sbatch "
        "sets it); 'off' disables replacement jobs",
    )
    p.add_argument(
        "--min-nodes-timeout",
        type=float,
        default=float(env_default("min_nodes_timeout", "300") or 300),
        help="seconds below MIN nodes before the job is requeued (default 300)",
    )
    p.add_argument(
        "--requeue",
        action=argparse.BooleanOptionalAction,
        default=(env_default("requeue", "1") or "1") not in ("0", "false", "no"),
        help="under Slurm, requeue the job when it stays below MIN nodes (default on)",
    )
    p.set_defaults(func=_master)


def master_config(args: argparse.Namespace) -> MasterConfig:
    from dlrover_hpc.cli.run_args import default_job_dir

    nnodes = NodeRange.parse(args.nnodes)
    import os

    return MasterConfig(
        host=args.host,
        port=args.port,
        nnodes=nnodes,
        node_unit=args.node_unit,
        topology=args.topology,
        drain=DrainMode(args.drain),
        job_dir=args.job_dir or default_job_dir(),
        job_id=os.environ.get("SLURM_JOB_ID", "standalone"),
        max_restarts=args.max_restarts,
        heartbeat_timeout_s=args.heartbeat_timeout,
        last_call_s=args.last_call,
        netcheck_timeout_s=args.netcheck_timeout,
        replacement_sbatch=None
        if args.replacement_sbatch in (None, "", "off")
        else args.replacement_sbatch,
        min_nodes_timeout_s=args.min_nodes_timeout,
        requeue=args.requeue,
    )


def _master(args: argparse.Namespace) -> int:
    config = master_config(args)
    from dlrover_hpc.master.server import run_master

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


def _drain(args: argparse.Namespace) -> int:
    from dlrover_hpc.slurm import commands as slurm

    if not args.reason.strip():
        raise ConfigError("--reason must not be empty; say why the node is drained")
    result = slurm.drain_node(args.node, reason=f"dlrover-hpc: {args.reason}")
    if result.ok:
        print(f"drained {args.node}: {args.reason}")
        return 0
    print(f"Slurm refused to drain {args.node}: {result.error}")
    print(f"ask an admin to run: {result.admin_command}")
    return 1


def register_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="bare metal: start the master here and one agent per host over SSH",
        description="Start the job master locally and dlrover-run on every host of the "
        "hostfile over SSH; hosts beyond the active count are hot spares.",
    )
    p.add_argument("--hostfile", required=True, help="one host per line, optional slots=N")
    p.add_argument("--spares", type=int, default=0, help="hosts kept as hot spares")
    p.add_argument("--ssh-user", default=None, help="SSH user (default: yours)")
    p.add_argument("--ssh-key", default=None, help="SSH private key file")
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then dlrover-run's arguments")
    from dlrover_hpc.ssh.cli import add_launch_options

    add_launch_options(p)
    p.set_defaults(func=_launch)


def _launch(args: argparse.Namespace) -> int:
    from dlrover_hpc.ssh.cli import run_launch  # asyncssh and torch: only when used

    return run_launch(args)


def register_status(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "status",
        help="nodes, node ranks, states and restarts of a running job",
        description="Ask the job master (found through --master, $DLROVER_HPC_MASTER or the "
        "job directory's master.json) for its node table.",
    )
    p.add_argument("--master", default=env_default("master", None), help="HOST:PORT")
    p.add_argument("--job-dir", default=env_default("job_dir", None), help="job directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_status)


def _status(args: argparse.Namespace) -> int:
    from dlrover_hpc.master.status import print_status

    return print_status(master=args.master, job_dir=args.job_dir, as_json=args.json)
