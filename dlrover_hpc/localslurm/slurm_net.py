"""The local Slurm's networks: bridges, a namespace per node, its links, and faults on them.

Two bridges: ``control`` (eth0 in each node: Slurm and the master) and ``data`` (eth1: "the
fabric", which can fail on its own).  Each node's network namespace has a veth on each bridge.
"""

from __future__ import annotations

from pathlib import Path

from dlrover_hpc.localslurm.slurm_config import LocalSlurmConfig
from dlrover_hpc.localslurm.slurm_procs import alive, run


def ifname(net: str) -> str:
    """The interface inside the node: eth0 on ``control``, eth1 on ``data``."""
    return "eth0" if net == "control" else "eth1"


def setup_network(cfg: LocalSlurmConfig) -> None:
    """Create (or complete) both bridges and every node's namespace and links.  Idempotent."""
    nets = (("control", cfg.bridge, cfg.subnet), ("data", cfg.data_bridge, cfg.data_subnet))
    for _net, br, subnet in nets:
        if not Path(f"/sys/class/net/{br}").exists():
            run(["ip", "link", "add", br, "type", "bridge"])
            run(["ip", "addr", "add", f"{subnet}.254/24", "dev", br])
        run(["ip", "link", "set", br, "up"])
    for node in cfg.node_names():
        ns = cfg.netns(node)
        if not Path(f"/run/netns/{ns}").exists():
            run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        index = cfg.address(node).rsplit(".", 1)[1]
        for net, br, subnet in nets:
            veth, inner = cfg.veth(node, net), ifname(net)
            if not Path(f"/sys/class/net/{veth}").exists():
                run(["ip", "link", "add", veth, "type", "veth", "peer", "name", inner, "netns", ns])
            run(["ip", "link", "set", veth, "master", br, "up"])
            run(["ip", "-n", ns, "addr", "replace", f"{subnet}.{index}/24", "dev", inner])
            run(["ip", "-n", ns, "link", "set", inner, "up"])


def remove_network(cfg: LocalSlurmConfig, nodes: list[str]) -> None:
    """Delete the nodes' namespaces and links, then both bridges; what is already gone is fine."""
    for node in nodes:
        ns = cfg.netns(node)
        if Path(f"/run/netns/{ns}").exists():
            run(["ip", "netns", "del", ns], check=False)
        for net in ("control", "data"):
            if Path(f"/sys/class/net/{cfg.veth(node, net)}").exists():
                run(["ip", "link", "del", cfg.veth(node, net)], check=False)
    for br in (cfg.bridge, cfg.data_bridge):
        if Path(f"/sys/class/net/{br}").exists():
            run(["ip", "link", "del", br], check=False)


def netns_pids(cfg: LocalSlurmConfig, node: str) -> list[int]:
    """Live processes in the node's network namespace (empty when it has none)."""
    ns = cfg.netns(node)
    if not Path(f"/run/netns/{ns}").exists():
        return []
    out = run(["ip", "netns", "pids", ns], check=False)
    return [int(p) for p in out.split() if p.isdigit() and alive(int(p))]


def cut_link(cfg: LocalSlurmConfig, node: str, *, net: str) -> None:
    run(["ip", "link", "set", cfg.veth(node, net), "down"])


def heal_link(cfg: LocalSlurmConfig, node: str, *, net: str) -> None:
    bridge = cfg.bridge if net == "control" else cfg.data_bridge
    run(["ip", "link", "set", cfg.veth(node, net), "up"])
    run(["ip", "link", "set", cfg.veth(node, net), "master", bridge])


def slow_link(cfg: LocalSlurmConfig, node: str, *, rate: str, net: str) -> None:
    """Rate-limit the node's outgoing traffic (tbf; this kernel has no netem)."""
    run(
        [
            "tc",
            "-n",
            cfg.netns(node),
            "qdisc",
            "replace",
            "dev",
            ifname(net),
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "32kbit",
            "latency",
            "400ms",
        ]
    )


def unslow_link(cfg: LocalSlurmConfig, node: str, *, net: str) -> None:
    run(["tc", "-n", cfg.netns(node), "qdisc", "del", "dev", ifname(net), "root"], check=False)
