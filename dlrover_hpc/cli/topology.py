"""`dlrover-hpc topology ...`: show, validate, order, convert, edit and from-slurm.

`register(subparsers)` adds the sub-command to `dlrover-hpc`'s parser; each verb's
`func(args) -> int` returns the exit code. Bad input raises UsageError/TopologyError (the caller
prints it and exits 2); `validate` prints its `FILE:LINE:` lines itself and returns 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import hostlist

from dlrover_hpc.errors import SlurmError, UsageError
from dlrover_hpc.topology.blocks import block_losses
from dlrover_hpc.topology.edit import (
    EditResult,
    Operation,
    add_nodes,
    add_switch,
    edit_file,
    move_nodes,
    remove_nodes,
    remove_switch,
)
from dlrover_hpc.topology.files import load, read_text, render, scan, write_atomic
from dlrover_hpc.topology.model import TopologyFormat
from dlrover_hpc.topology.order import order_nodes
from dlrover_hpc.topology.scontrol import (
    SCONTROL_ARGV,
    parse_addr_lines,
    read_slurm_topology,
    topology_from_addrs,
)
from dlrover_hpc.topology.slurm_conf import HOSTLIST_EXAMPLE
from dlrover_hpc.topology.switch_list import switch_list_rows
from dlrover_hpc.topology.view import render_tree

_PROG = "dlrover-hpc"
_FORMATS = {
    "slurm": TopologyFormat.SLURM,
    "block": TopologyFormat.BLOCK,
    "switch-list": TopologyFormat.SWITCH_LIST,
}
_FILE_HELP = (
    "topology file: a Slurm topology.conf (tree plugin), a block.conf (block plugin), an"
    " 'ASW PSW HOST' switch list or saved `scontrol show topology` output; the format is"
    " detected"
)
_DESCRIPTION = """\
Work with switch-topology files. These formats are read (the format is detected):
  topology.conf (Slurm tree plugin):  SwitchName=leaf0 Nodes=node[1-4]
                                      SwitchName=spine0 Switches=leaf[0-3]
  block.conf (Slurm block plugin):    BlockName=block1 Nodes=node[1-18]
                                      BlockSizes=18
  switch list (one node per line):    asw-0 psw-0 node1
  saved `scontrol show topology` output of either plugin
Nodes under one leaf switch (or in one block) get adjacent node ranks, leaves under one upper
switch are adjacent, blocks and names go in natural order (node2 < node10), nodes not in the
file go last.
Examples are in topology/. Bad input exits 2 with FILE:LINE: what is wrong and how to fix it.
"""

_FROM_SLURM_DESCRIPTION = """\
Run `scontrol show topology` and write what it reports as a topology.conf.
With --addrs, build it instead from the SLURM_TOPOLOGY_ADDR values Slurm gives each task
of a job (no call to the controller), e.g.:
  srun --ntasks-per-node=1 sh -c \\
    'echo "$SLURMD_NODENAME $SLURM_TOPOLOGY_ADDR $SLURM_TOPOLOGY_ADDR_PATTERN"' \\
    | dlrover-hpc topology from-slurm --addrs - --output topology.conf
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `topology` and its verbs to the `dlrover-hpc` argument parser."""
    top = subparsers.add_parser(
        "topology",
        help="show, check, order, convert and edit switch-topology files",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = top.add_subparsers(dest="topology_verb", metavar="VERB", required=True)

    p = verbs.add_parser("show", help="print the switch tree", description="Print the tree.")
    p.add_argument("file", metavar="FILE", help=_FILE_HELP + "; - reads stdin")
    p.set_defaults(func=cmd_show)

    p = verbs.add_parser(
        "validate",
        help="check a file; exit 2 with FILE:LINE: problems",
        description="Check a topology file. Prints one 'FILE:LINE: what is wrong; how to fix"
        " it' line per problem on stderr and exits 2, or prints a summary and exits 0.",
    )
    p.add_argument("file", metavar="FILE", help=_FILE_HELP + "; - reads stdin")
    p.set_defaults(func=cmd_validate)

    p = verbs.add_parser(
        "order",
        help="print hosts one per line in node-rank order",
        description="Print hosts one per line in node-rank order. A host missing from the file"
        " goes last, with a warning on stderr naming it.",
    )
    p.add_argument("file", metavar="FILE", help=_FILE_HELP + "; - reads stdin")
    p.add_argument(
        "--nodes",
        metavar="HOSTLIST",
        help=f"hosts to order, as a Slurm hostlist ({HOSTLIST_EXAMPLE}); default: every node"
        " in FILE",
    )
    p.set_defaults(func=cmd_order)

    p = verbs.add_parser(
        "convert",
        help="write the topology in another format",
        description="Write the topology as a topology.conf, a block.conf or a switch list.",
    )
    p.add_argument("file", metavar="FILE", help=_FILE_HELP + "; - reads stdin")
    p.add_argument("--to", required=True, choices=sorted(_FORMATS), help="output format")
    p.add_argument("--output", "-o", metavar="OUT", help="write OUT atomically (default: stdout)")
    p.set_defaults(func=cmd_convert)

    _register_edits(verbs)

    p = verbs.add_parser(
        "from-slurm",
        help="write a topology.conf from the live cluster (scontrol show topology)",
        description=_FROM_SLURM_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--addrs",
        metavar="FILE",
        help="read 'HOST SLURM_TOPOLOGY_ADDR [PATTERN]' lines from FILE (- for stdin) instead"
        " of running scontrol",
    )
    p.add_argument("--output", "-o", metavar="FILE", help="write FILE atomically (default: stdout)")
    p.add_argument(
        "--timeout-s", type=float, default=30.0, metavar="S", help="scontrol timeout (default 30)"
    )
    p.set_defaults(func=cmd_from_slurm)


def _register_edits(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    edit_note = " The file is validated first, comments are kept and it is replaced atomically."
    file_help = "topology.conf or switch list to edit"

    p = verbs.add_parser(
        "add-node",
        help="add nodes under a leaf switch",
        description="Add new nodes under a leaf switch." + edit_note,
    )
    p.add_argument("file", metavar="FILE", help=file_help)
    p.add_argument("nodes", metavar="HOSTLIST", help=f"nodes to add ({HOSTLIST_EXAMPLE})")
    p.add_argument("--switch", required=True, metavar="LEAF", help="leaf switch to put them under")
    p.set_defaults(func=cmd_add_node)

    p = verbs.add_parser(
        "move-node",
        help="move nodes to another leaf switch",
        description="Move nodes that are in the file to another leaf switch." + edit_note,
    )
    p.add_argument("file", metavar="FILE", help=file_help)
    p.add_argument("nodes", metavar="HOSTLIST", help="nodes to move")
    p.add_argument(
        "--switch", "--to", dest="switch", required=True, metavar="LEAF", help="new leaf switch"
    )
    p.set_defaults(func=cmd_move_node)

    p = verbs.add_parser(
        "remove-node",
        help="remove nodes from the file",
        description="Remove nodes from the file." + edit_note,
    )
    p.add_argument("file", metavar="FILE", help=file_help)
    p.add_argument("nodes", metavar="HOSTLIST", help="nodes to remove")
    p.set_defaults(func=cmd_remove_node)

    p = verbs.add_parser(
        "add-switch",
        help="add a leaf switch (--nodes) or an upper switch (--switches)",
        description="Add a switch over new nodes (a leaf) or over existing switches. A missing"
        " file is created as a topology.conf." + edit_note,
    )
    p.add_argument("file", metavar="FILE", help=file_help)
    p.add_argument("name", metavar="NAME", help="name of the new switch")
    below = p.add_mutually_exclusive_group(required=True)
    below.add_argument("--nodes", metavar="HOSTLIST", help="new nodes under it (a leaf)")
    below.add_argument("--switches", metavar="NAMES", help="existing switches under it")
    p.add_argument("--parent", metavar="SWITCH", help="existing upper switch to put it under")
    p.add_argument("--link-speed", type=int, metavar="N", help="Slurm LinkSpeed= (optional)")
    p.set_defaults(func=cmd_add_switch)

    p = verbs.add_parser(
        "remove-switch",
        help="remove a switch and everything only reachable through it",
        description="Remove a switch, its nodes and the switches only reachable through it."
        + edit_note,
    )
    p.add_argument("file", metavar="FILE", help=file_help)
    p.add_argument("name", metavar="NAME", help="switch to remove")
    p.set_defaults(func=cmd_remove_switch)


def _hosts(value: str, flag: str) -> list[str]:
    try:
        hosts = list(hostlist.expand_hostlist(value))
    except hostlist.BadHostlist as exc:
        raise UsageError(
            f"{flag}: '{value}' is not a valid hostlist ({exc}); write e.g. {HOSTLIST_EXAMPLE}"
        ) from None
    if not hosts:
        raise UsageError(f"{flag}: '{value}' names no host; write e.g. {HOSTLIST_EXAMPLE}")
    return hosts


def _out(lines: Sequence[str]) -> None:
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    sys.stdout.flush()


def _warn(message: str) -> None:
    print(f"{_PROG}: warning: {message}", file=sys.stderr)


def cmd_show(args: argparse.Namespace) -> int:
    sys.stdout.write(render_tree(load(args.file)))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    text, source = read_text(args.file)
    topology, problems = scan(text, source=source)
    if problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        return 2
    n_nodes = len(topology.leaf_of())
    if topology.format.is_block:
        sizes = ",".join(str(n) for n in topology.block_sizes) or "not given"
        what = f"{len(topology.by_name())} blocks, {n_nodes} nodes, BlockSizes={sizes}"
    else:
        what = f"{len(topology.by_name())} switches, {n_nodes} nodes"
    _out([f"{source}: ok ({topology.format.value}, {what})"])
    return 0


def cmd_order(args: argparse.Namespace) -> int:
    topology = load(args.file)
    hosts = _hosts(args.nodes, "--nodes") if args.nodes is not None else topology.nodes()
    ordered, missing = order_nodes(topology, hosts)
    for host in missing:
        _warn(
            f"node '{host}' is not in {topology.source}; it goes last (add it with:"
            f" {_PROG} topology add-node {topology.source} {host} --switch"
            f" {'BLOCK' if topology.format.is_block else 'LEAF'})"
        )
    _out(ordered)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    topology = load(args.file)
    fmt = _FORMATS[args.to]
    if fmt is TopologyFormat.SWITCH_LIST:
        for loss in switch_list_rows(topology)[1]:
            _warn(loss)
    if fmt is TopologyFormat.BLOCK:
        for loss in block_losses(topology):
            _warn(loss)
    text = render(topology, fmt, header=f"Converted from {topology.source} by {_PROG} topology")
    _emit(text, args.output)
    return 0


def _emit(text: str, output: str | None) -> None:
    if output:
        write_atomic(output, text)
        print(f"wrote {output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()


def cmd_from_slurm(args: argparse.Namespace) -> int:
    if args.timeout_s <= 0:
        raise UsageError(f"--timeout-s {args.timeout_s:g} must be > 0")
    if args.addrs is not None:
        text, source = read_text(args.addrs)
        topology = topology_from_addrs(parse_addr_lines(text, source=source))
        header = f"Written by `{_PROG} topology from-slurm` from SLURM_TOPOLOGY_ADDR values."
        _emit(render(topology, TopologyFormat.SLURM, header=header), args.output)
        return 0
    try:
        topology = read_slurm_topology(timeout_s=args.timeout_s)
    except SlurmError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 1
    header = f"Written by `{_PROG} topology from-slurm` from `{' '.join(SCONTROL_ARGV)}`."
    fmt = TopologyFormat.BLOCK if topology.format.is_block else TopologyFormat.SLURM
    _emit(render(topology, fmt, header=header), args.output)
    return 0


def _run_edit(args: argparse.Namespace, operation: Operation, *, create: bool = False) -> int:
    result: EditResult = edit_file(args.file, operation, create=create)
    print(f"{args.file}: {result.summary}")
    return 0


def cmd_add_node(args: argparse.Namespace) -> int:
    hosts = _hosts(args.nodes, "HOSTLIST")
    return _run_edit(args, functools.partial(add_nodes, hosts=hosts, switch=args.switch))


def cmd_move_node(args: argparse.Namespace) -> int:
    hosts = _hosts(args.nodes, "HOSTLIST")
    return _run_edit(args, functools.partial(move_nodes, hosts=hosts, switch=args.switch))


def cmd_remove_node(args: argparse.Namespace) -> int:
    hosts = _hosts(args.nodes, "HOSTLIST")
    return _run_edit(args, functools.partial(remove_nodes, hosts=hosts))


def cmd_add_switch(args: argparse.Namespace) -> int:
    nodes = _hosts(args.nodes, "--nodes") if args.nodes is not None else []
    switches = _hosts(args.switches, "--switches") if args.switches is not None else []
    operation = functools.partial(
        add_switch,
        name=args.name,
        nodes=nodes,
        switches=switches,
        parent=args.parent,
        link_speed=args.link_speed,
    )
    return _run_edit(args, operation, create=True)


def cmd_remove_switch(args: argparse.Namespace) -> int:
    return _run_edit(args, functools.partial(remove_switch, name=args.name))
