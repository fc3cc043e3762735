"""``dlrover-hpc local-slurm up|down|status``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dlrover_hpc.localslurm.local_slurm import LocalSlurm, LocalSlurmConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "local-slurm",
        help="a real multi-node Slurm on this one machine (root)",
        description="Run slurmctld plus one slurmd per node, each node in its own network "
        "namespace with its own address and host name (for the demo, development and tests).",
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="{up,down,status}")
    up = verbs.add_parser("up", help="start the cluster (installs Slurm and munge if missing)")
    up.add_argument("--nodes", type=int, default=4, help="number of nodes (default 4)")
    _cluster_flag(up)
    up.add_argument(
        "--topology",
        type=Path,
        default=None,
        help="topology file for topology/tree (default: two leaves, one spine)",
    )
    up.set_defaults(func=_up)
    down = verbs.add_parser("down", help="stop our daemons, remove our namespaces and config")
    _cluster_flag(down)
    down.set_defaults(func=_down)
    st = verbs.add_parser("status", help="print the nodes and their Slurm state")
    _cluster_flag(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_status)


def _cluster_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="N",
        help="which of several local clusters side by side (default 0, the one at "
        "/etc/slurm/slurm.conf; N >= 1 has its own names, addresses and SLURM_CONF)",
    )


def _conf_hint(cluster: LocalSlurm) -> str:
    conf = cluster.config.slurm_conf
    return f"SLURM_CONF={conf} " if cluster.config.index else ""


def _up(args: argparse.Namespace) -> int:
    from rich.console import Console

    cluster = LocalSlurm(
        LocalSlurmConfig(nodes=args.nodes, topology=args.topology, index=args.cluster)
    )
    console = Console(stderr=True)
    if console.is_terminal:
        with console.status("local Slurm: starting") as status:
            took = cluster.up(say=lambda what: status.update(f"local Slurm: {what}"))
    else:  # a log: one line per stage
        took = cluster.up(say=lambda what: print(f"local Slurm: {what}", file=sys.stderr))
    print(
        f"local Slurm up: {args.nodes} nodes in {took:.1f} s; "
        f"try: {_conf_hint(cluster)}srun -N{args.nodes} hostname"
    )
    return 0


def _down(args: argparse.Namespace) -> int:
    took = LocalSlurm(LocalSlurmConfig(index=args.cluster)).down()
    print(f"local Slurm down in {took:.1f} s")
    return 0


def _status(args: argparse.Namespace) -> int:
    status = LocalSlurm(LocalSlurmConfig(index=args.cluster)).status()
    if args.json:
        print(json.dumps(status, indent=1))
    elif not status["up"] and "nodes" not in status:
        print("local Slurm is down")
    else:
        print(f"slurmctld: {'up' if status['up'] else 'DOWN'} pid={status['slurmctld_pid']}")
        print(f"{'NODE':<10}{'ADDRESS':<14}{'SLURMD':<10}STATE")
        for n in status["nodes"]:
            alive = "up" if n["slurmd_alive"] else "dead"
            print(f"{n['name']:<10}{n['address']:<14}{alive:<10}{n['state']}")
    return 0 if status["up"] else 1
