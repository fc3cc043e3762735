"""The live cluster's topology: `scontrol show topology` output and SLURM_TOPOLOGY_ADDR.

`scontrol show topology` (tree plugin) prints one switch per line::

    SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node1,node2
    SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]

An upper switch's `Nodes=` lists every node below it, so only a leaf's `Nodes=` is kept. Under
the tree plugin Slurm also gives every task `SLURM_TOPOLOGY_ADDR` (e.g. `spine1.leaf1.node1`,
root first) and `SLURM_TOPOLOGY_ADDR_PATTERN` (`switch.switch.node`); `topology_from_addrs`
builds the same tree from those, with no call to the controller.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import hostlist

from dlrover_hpc.errors import SlurmError, TopologyError
from dlrover_hpc.topology.blocks import SCONTROL_BLOCK_KEY, parse_scontrol_blocks
from dlrover_hpc.topology.model import (
    Problem,
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    bad_name_reason,
    check,
)
from dlrover_hpc.topology.slurm_conf import expand

logger = logging.getLogger(__name__)

SCONTROL_ARGV = ("scontrol", "show", "topology")
SCONTROL_SOURCE = "scontrol show topology"
ADDR_SOURCE = "SLURM_TOPOLOGY_ADDR"
_SLURM_DEFAULT_LINK_SPEED = 1
# Some Slurm releases format "Nodes=%s " into a 512-byte buffer, cutting a longer value to
# exactly this length; a value of this length is taken as cut (the fix is cheap: copy the file).
_TRUNCATED_VALUE_LEN = 511 - len("Nodes=")


def parse_scontrol_topology(text: str, *, source: str = SCONTROL_SOURCE) -> Topology:
    """Parse `scontrol show topology` output; raises TopologyError naming the bad line.

    `LinkSpeed=1` (Slurm's default) is read as "not given". Keys other than SwitchName, Level,
    LinkSpeed, Nodes and Switches are ignored, so newer Slurm versions' extra fields do no harm.
    Output of the block plugin (`BlockName=... BlockIndex=...` lines) is read as blocks
    (`blocks.parse_scontrol_blocks`).
    """
    first = next((line for line in text.splitlines() if line.strip()), "")
    if SCONTROL_BLOCK_KEY.match(first):
        return parse_scontrol_blocks(text, source=source)
    switches: list[Switch] = []
    problems: list[Problem] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            switches.append(_parse_record(raw, number))
        except ValueError as exc:
            problems.append(
                Problem(kind=ProblemKind.BAD_SYNTAX, source=source, line=number, message=str(exc))
            )
    topology = Topology(switches=tuple(switches), source=source, format=TopologyFormat.SCONTROL)
    if not switches and not problems:
        raise TopologyError(
            f"{source}: printed no switches, so Slurm has no tree topology here; set"
            " TopologyPlugin=topology/tree in slurm.conf and describe the switches in"
            " topology.conf, or pass a topology file instead"
        )
    if not problems:
        problems = check(topology)
    if problems:
        raise TopologyProblems(problems)
    return topology


def _parse_record(raw: str, number: int) -> Switch:
    fields: dict[str, str] = {}
    for token in raw.split():
        key, eq, value = token.partition("=")
        if not eq:
            raise ValueError(
                f"cannot read '{raw.strip()}': '{token}' is not KEY=VALUE; expected lines like"
                " 'SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1-2]'"
            )
        fields[key.lower()] = "" if value == "(null)" else value
    if "blockname" in fields or "aggregatedblock" in fields:
        raise ValueError(
            "a block-plugin line (BlockName=) in tree-plugin output; Slurm prints one plugin's"
            " lines: save the whole `scontrol show topology` output of one cluster"
        )
    name = fields.get("switchname", "")
    if bad_name_reason(name):
        raise ValueError(
            f"cannot read '{raw.strip()}': no usable SwitchName=; expected lines like"
            " 'SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1-2]'"
        )
    for key in ("nodes", "switches"):
        value = fields.get(key, "")
        if len(value) == _TRUNCATED_VALUE_LEN:
            raise ValueError(
                f"switch '{name}': scontrol may have cut its {key.title()}= list short (a limit"
                " of some Slurm releases); copy topology.conf from the controller instead"
            )
    link_speed: int | None = None
    speed = fields.get("linkspeed", "")
    if speed.isdigit() and int(speed) != _SLURM_DEFAULT_LINK_SPEED:
        link_speed = int(speed)
    try:
        children = tuple(expand(fields["switches"])) if fields.get("switches") else ()
        nodes = () if children or not fields.get("nodes") else tuple(expand(fields["nodes"]))
    except hostlist.BadHostlist as exc:
        raise ValueError(f"switch '{name}': malformed hostlist ({exc})") from exc
    return Switch(name=name, nodes=nodes, switches=children, link_speed=link_speed, line=number)


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs an argv list (never a shell string) with a timeout."""

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> CommandResult: ...


def run_subprocess(argv: Sequence[str], *, timeout_s: float) -> CommandResult:
    """The real `CommandRunner`; raises SlurmError when the command cannot run or times out."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError as exc:
        raise SlurmError(
            f"cannot run '{argv[0]}': not found on PATH; run this on a Slurm login or compute"
            " node, or load Slurm's environment module"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(
            f"'{' '.join(argv)}' did not answer within {timeout_s:g} s; check that slurmctld is"
            " up (scontrol ping) or raise --timeout-s"
        ) from exc
    return CommandResult(returncode=done.returncode, stdout=done.stdout, stderr=done.stderr)


def read_slurm_topology(
    *, runner: CommandRunner = run_subprocess, timeout_s: float = 30.0
) -> Topology:
    """Run `scontrol show topology` and parse it; raises SlurmError or TopologyError."""
    result = runner(SCONTROL_ARGV, timeout_s=timeout_s)
    logger.debug("scontrol_topology_read rc=%d bytes=%d", result.returncode, len(result.stdout))
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()
        raise SlurmError(
            f"'{' '.join(SCONTROL_ARGV)}' failed with exit code {result.returncode}"
            + (f": {detail[-1]}" if detail else "")
            + "; check that Slurm is reachable (scontrol ping)"
        )
    return parse_scontrol_topology(result.stdout)


@dataclass(frozen=True, slots=True, kw_only=True)
class TopologyAddr:
    """A node's place in the tree as Slurm gives it in SLURM_TOPOLOGY_ADDR."""

    switches: tuple[str, ...]  # root first, leaf last; empty when the node is on no switch
    node: str


def parse_topology_addr(addr: str, pattern: str | None = None) -> TopologyAddr:
    """Split SLURM_TOPOLOGY_ADDR using SLURM_TOPOLOGY_ADDR_PATTERN when given.

    Without a pattern every field but the last is a switch. With one, as many leading fields
    as the pattern has `switch` fields are switches and the rest is the node name (so a node
    name may contain dots). Raises ValueError for an empty field.
    """
    fields = addr.strip().split(".")
    if pattern:
        n_switches = pattern.strip().split(".").count("switch")
        switches, node = fields[:n_switches], ".".join(fields[n_switches:])
    else:
        switches, node = fields[:-1], fields[-1]
    if not node or any(not s for s in switches):
        raise ValueError(
            f"SLURM_TOPOLOGY_ADDR '{addr}' has an empty field; expected e.g. 'spine1.leaf1.node1'"
        )
    return TopologyAddr(switches=tuple(switches), node=node)


def read_topology_addr(environ: Mapping[str, str]) -> TopologyAddr | None:
    """This node's SLURM_TOPOLOGY_ADDR from `environ`, or None where Slurm did not set it."""
    addr = environ.get("SLURM_TOPOLOGY_ADDR", "").strip()
    if not addr:
        return None
    return parse_topology_addr(addr, environ.get("SLURM_TOPOLOGY_ADDR_PATTERN"))


def parse_addr_lines(text: str, *, source: str) -> dict[str, TopologyAddr]:
    """Read `HOST ADDR [PATTERN]` lines (or bare `ADDR` lines) into host -> address.

    Made for collecting addresses from a job, e.g. `srun --ntasks-per-node=1 sh -c 'echo
    "$SLURMD_NODENAME $SLURM_TOPOLOGY_ADDR $SLURM_TOPOLOGY_ADDR_PATTERN"'`. A bare ADDR names
    its node by its last field. `#` starts a comment. Raises TopologyError naming FILE:LINE.
    """
    out: dict[str, TopologyAddr] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 3:
            raise TopologyError(
                f"{source}:{number}: expected 'HOST SLURM_TOPOLOGY_ADDR [PATTERN]', got"
                f" {len(fields)} fields; write e.g. 'node1 spine1.leaf1.node1 switch.switch.node'"
            )
        addr_text = fields[0] if len(fields) == 1 else fields[1]
        pattern = fields[2] if len(fields) == 3 else None
        try:
            addr = parse_topology_addr(addr_text, pattern)
        except ValueError as exc:
            raise TopologyError(f"{source}:{number}: {exc}") from None
        host = fields[0] if len(fields) > 1 else addr.node
        if bad_name_reason(host):
            raise TopologyError(f"{source}:{number}: '{host}' is not a host name")
        if host in out and out[host] != addr:
            raise TopologyError(
                f"{source}:{number}: host '{host}' has a second, different address; keep one"
            )
        out[host] = addr
    return out


def topology_from_addrs(addrs: Mapping[str, TopologyAddr | str]) -> Topology:
    """Build the switch tree from each host's SLURM_TOPOLOGY_ADDR (host -> address).

    The mapping's key is taken as the node name (it is the name the caller orders by). Hosts on
    no switch are left out, so `order_nodes` puts them last. Raises TopologyError when two
    hosts disagree (a node under two leaves, a cycle).
    """
    leaf_nodes: dict[str, list[str]] = {}
    kids: dict[str, list[str]] = {}
    first_seen: dict[str, int] = {}
    for index, host in enumerate(sorted(addrs)):
        value = addrs[host]
        try:
            addr = parse_topology_addr(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise TopologyError(f"{ADDR_SOURCE} of {host}: {exc}") from exc
        if not addr.switches:
            continue
        for upper, lower in zip(addr.switches, addr.switches[1:], strict=False):
            first_seen.setdefault(upper, index)
            siblings = kids.setdefault(upper, [])
            if lower not in siblings:
                siblings.append(lower)
        leaf = addr.switches[-1]
        first_seen.setdefault(leaf, index)
        leaf_nodes.setdefault(leaf, []).append(host)
    names = sorted(first_seen, key=lambda n: (first_seen[n], n))
    switches = tuple(
        Switch(
            name=name,
            nodes=tuple(leaf_nodes.get(name, ())),
            switches=tuple(kids.get(name, ())),
        )
        for name in names
    )
    topology = Topology(switches=switches, source=ADDR_SOURCE, format=TopologyFormat.TOPOLOGY_ADDR)
    problems = [p for p in check(topology) if p.kind is not ProblemKind.EMPTY]
    if problems:
        raise TopologyError(
            f"{ADDR_SOURCE} values do not form one tree: " + "; ".join(p.message for p in problems)
        )
    return topology
