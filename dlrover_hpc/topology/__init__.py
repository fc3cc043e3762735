"""Switch topology: parse Slurm topology.conf / switch lists / scontrol output, order node ranks.

Public API::

    topology = load("topology/fat-tree.conf")          # any supported format, detected
    ordered, missing = order_nodes(topology, hosts)     # pure; topology may be None
    topology = parse_scontrol_topology(text)            # `scontrol show topology` output
    topology = topology_from_addrs({host: os.environ["SLURM_TOPOLOGY_ADDR"], ...})

Errors are `dlrover_hpc.errors.TopologyError` with `FILE:LINE: what is wrong; how to fix it`.
"""

from dlrover_hpc.topology.files import detect_format, load, loads, render, scan, write_atomic
from dlrover_hpc.topology.model import (
    Problem,
    ProblemKind,
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    check,
    natural_key,
    natural_sorted,
    switch_levels,
)
from dlrover_hpc.topology.order import order_nodes, rank_order
from dlrover_hpc.topology.scontrol import (
    TopologyAddr,
    parse_addr_lines,
    parse_scontrol_topology,
    parse_topology_addr,
    read_slurm_topology,
    read_topology_addr,
    topology_from_addrs,
)
from dlrover_hpc.topology.slurm_conf import parse_slurm_conf, render_slurm_conf
from dlrover_hpc.topology.switch_list import parse_switch_list, render_switch_list

__all__ = [
    "Problem",
    "ProblemKind",
    "Switch",
    "Topology",
    "TopologyAddr",
    "TopologyFormat",
    "TopologyProblems",
    "check",
    "detect_format",
    "load",
    "loads",
    "natural_key",
    "natural_sorted",
    "order_nodes",
    "parse_addr_lines",
    "parse_scontrol_topology",
    "parse_slurm_conf",
    "parse_switch_list",
    "parse_topology_addr",
    "rank_order",
    "read_slurm_topology",
    "read_topology_addr",
    "render",
    "render_slurm_conf",
    "render_switch_list",
    "scan",
    "switch_levels",
    "topology_from_addrs",
    "write_atomic",
]
