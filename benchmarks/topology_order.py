"""Benchmark: topology-aware rank order of 10,000 nodes under 4,000 leaf switches (goal < 1 s).

Builds a three-level tree (4,000 leaves, 100 spines, 1 core) with nodes scattered over the
leaves at random (fixed seed), writes it as topology.conf text, parses it, then times
`order_nodes` on the hosts in shuffled order plus a few hosts missing from the file. Prints one
JSON line. Run: `nice python benchmarks/topology_order.py [--nodes N] [--leaves L]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from dlrover_hpc.topology import Switch, Topology, loads, order_nodes, render_slurm_conf

GOAL_S = 1.0


def build(n_nodes: int, n_leaves: int, n_spines: int, seed: int) -> Topology:
    rng = random.Random(seed)
    hosts = [f"gpu{i:05d}" for i in range(n_nodes)]
    rng.shuffle(hosts)
    per_leaf: list[list[str]] = [[] for _ in range(n_leaves)]
    for i, host in enumerate(hosts):
        per_leaf[i % n_leaves].append(host)
    leaves = [Switch(name=f"leaf{i}", nodes=tuple(nodes)) for i, nodes in enumerate(per_leaf)]
    spines = [
        Switch(
            name=f"spine{s}",
            switches=tuple(f"leaf{i}" for i in range(s, n_leaves, n_spines)),
        )
        for s in range(n_spines)
    ]
    core = Switch(name="core", switches=tuple(sw.name for sw in spines))
    return Topology(switches=(*leaves, *spines, core))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--leaves", type=int, default=4_000)
    parser.add_argument("--spines", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)

    text = render_slurm_conf(build(args.nodes, args.leaves, args.spines, args.seed))
    start = time.perf_counter()
    topology = loads(text, source="bench.conf")
    parse_s = time.perf_counter() - start

    hosts = [*topology.nodes(), "missing-b", "missing-a"]
    random.Random(args.seed).shuffle(hosts)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        ordered, missing = order_nodes(topology, hosts)
        runs.append(time.perf_counter() - start)
    assert len(ordered) == len(hosts) and missing == ["missing-a", "missing-b"]

    seconds = statistics.median(runs)
    print(
        json.dumps(
            {
                "bench": "topology_order",
                "nodes": args.nodes,
                "leaves": args.leaves,
                "spines": args.spines,
                "seconds": round(seconds, 4),
                "max_seconds": round(max(runs), 4),
                "repeats": args.repeats,
                "parse_seconds": round(parse_s, 4),
                "goal_s": GOAL_S,
                "ok": seconds < GOAL_S,
            }
        )
    )
    return 0 if seconds < GOAL_S else 1


if __name__ == "__main__":
    sys.exit(main())
