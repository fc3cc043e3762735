"""Benchmark: block topologies at scale: parse, rank order, and a --segment round's decision.

Builds an NVL72-style block.conf (blocks of 18 nodes, BlockSizes=18), parses it, orders the
hosts (shuffled), and times one rendezvous decision with --segment 16 over every waiting node
(the master makes it as a round forms, after its block/rank places), with 1 % of the nodes
lost, against the same decision without segments (the baseline, same run). Prints one JSON
line. Run: `nice python benchmarks/blocks.py [--nodes N] [--segment S]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from dlrover_hpc.rendezvous.ranking import RankInput, block_places
from dlrover_hpc.rendezvous.state import DecisionKind, RdzvParams, Waiter, decide
from dlrover_hpc.topology import loads, order_nodes

BLOCK = 18


def block_conf(n_nodes: int) -> str:
    lines = [
        f"BlockName=nvl{b:04d} Nodes=gpu[{b * BLOCK:05d}-{min(n_nodes, (b + 1) * BLOCK) - 1:05d}]"
        for b in range((n_nodes + BLOCK - 1) // BLOCK)
    ]
    return "\n".join([*lines, f"BlockSizes={BLOCK}", ""])


def best_of(repeats: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=16384)
    p.add_argument("--segment", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(7)
    text = block_conf(args.nodes)
    parse_s = best_of(args.repeats, lambda: loads(text, source="bench"))
    topology = loads(text, source="bench")
    hosts = [f"gpu{i:05d}" for i in range(args.nodes)]
    rng.shuffle(hosts)
    order_s = best_of(args.repeats, lambda: order_nodes(topology, hosts))
    alive = [h for h in hosts if rng.random() > 0.01]  # 1 % lost
    inputs = [RankInput(agent_id=h, node=h) for h in alive]
    places_s = best_of(args.repeats, lambda: block_places(inputs, topology))
    places = block_places(inputs, topology)
    waiting = [
        Waiter(agent_id=h, joined_at=0.0, was_active=True, block=places[h][0], order=places[h][1])
        for h in alive
    ]
    seg = args.segment
    target = len(alive) // 2 // seg * seg
    params = RdzvParams(min_nodes=seg, max_nodes=target, segment=seg)
    plain = RdzvParams(min_nodes=seg, max_nodes=target)

    def run(prm: RdzvParams) -> tuple[str, ...]:
        d = decide(params=prm, waiting=waiting, alive=len(waiting), opened_at=0.0, now=1.0)
        assert d.kind is DecisionKind.COMPLETE
        return d.chosen

    decide_s = best_of(args.repeats, lambda: run(params))
    baseline_s = best_of(args.repeats, lambda: run(plain))
    chosen = run(params)
    per_block: dict[str, int] = {}
    for agent in chosen:
        per_block[places[agent][0]] = per_block.get(places[agent][0], 0) + 1
    print(
        json.dumps(
            {
                "nodes": args.nodes,
                "blocks": len(topology.switches),
                "segment": seg,
                "waiting": len(waiting),
                "chosen": len(chosen),
                "every_block_whole_segments": all(n % seg == 0 for n in per_block.values()),
                "parse_s": round(parse_s, 4),
                "order_s": round(order_s, 4),
                "places_s": round(places_s, 4),
                "decide_segments_s": round(decide_s, 4),
                "decide_plain_s": round(baseline_s, 4),
                "segments_vs_plain": round(decide_s / baseline_s, 2),
                "median_block_nodes": statistics.median(len(b.nodes) for b in topology.switches),
            }
        )
    )


if __name__ == "__main__":
    main()
