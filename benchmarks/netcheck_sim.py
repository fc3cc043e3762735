"""Simulated network check on 256 nodes with injected faulty nodes and stragglers.

Runs the real planning and analysis (`dlrover_hpc.netcheck.analysis.run_check`) against a
simulated cluster: a group fails iff it holds a faulty node, and every member of a passing group
takes as long as its slowest member (a collective waits for everyone), which is the hard case
for straggler detection. Prints one JSON line; exits 1 if a goal is missed:

* 1 faulty node found in 2 rounds; up to 25% faulty found in at most 3 rounds;
* no healthy node ever blamed; every faulty node and every straggler found.

Usage: nice python benchmarks/netcheck_sim.py [--nodes 256] [--trials 20] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrover_hpc.netcheck.analysis import Group, GroupResult, RoundResult, run_check


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    faulty: Callable[[list[str], random.Random], set[str]]
    stragglers: Callable[[list[str], random.Random], set[str]] = lambda nodes, rng: set()
    max_rounds_goal: int = 3


def _share(share: float) -> Callable[[list[str], random.Random], set[str]]:
    return lambda nodes, rng: set(rng.sample(nodes, round(len(nodes) * share)))


def _count(count: int) -> Callable[[list[str], random.Random], set[str]]:
    return lambda nodes, rng: set(rng.sample(nodes, count))


def _one_per_pair(nodes: list[str], rng: random.Random) -> set[str]:
    """The worst case for 25%: one faulty node in each of half the round-1 pairs."""
    pairs = [nodes[i : i + 2] for i in range(0, len(nodes) - 1, 2)]
    return {rng.choice(pair) for pair in rng.sample(pairs, len(nodes) // 4)}


SCENARIOS = (
    Scenario(name="healthy", faulty=_count(0), max_rounds_goal=1),
    Scenario(name="one_faulty", faulty=_count(1), max_rounds_goal=2),
    Scenario(name="faulty_5pct", faulty=_share(0.05)),
    Scenario(name="faulty_25pct", faulty=_share(0.25)),
    Scenario(name="faulty_25pct_one_per_pair", faulty=_one_per_pair),
    Scenario(name="stragglers_2pct", faulty=_count(0), stragglers=_share(0.02)),
    Scenario(name="faulty_5pct_stragglers_2pct", faulty=_share(0.05), stragglers=_share(0.02)),
)


def simulate(
    faulty: set[str], base_s: dict[str, float]
) -> Callable[[int, list[Group]], RoundResult]:
    def run_round(index: int, groups: list[Group]) -> RoundResult:
        results = []
        for group in groups:
            ok = not faulty.intersection(group)
            slowest = max(base_s[n] for n in group)
            elapsed = {n: slowest for n in group} if ok else {}
            results.append(GroupResult(nodes=group, ok=ok, elapsed_s=elapsed))
        return RoundResult(round_index=index, groups=tuple(results))

    return run_round


def run_scenario(scenario: Scenario, *, nodes: list[str], trials: int, seed: int) -> dict:
    rounds_used, blamed, missed, straggler_errors, analysis_ms, unresolved = [], 0, 0, 0, [], 0
    for trial in range(trials):
        rng = random.Random(f"{seed}/{scenario.name}/{trial}")
        faulty = scenario.faulty(nodes, rng)
        slow = scenario.stragglers([n for n in nodes if n not in faulty], rng)
        base = {n: rng.uniform(3.0, 4.0) if n in slow else rng.uniform(0.9, 1.1) for n in nodes}
        sim = simulate(faulty, base)
        sim_s = 0.0

        def timed_sim(index: int, groups: list[Group], sim=sim) -> RoundResult:
            nonlocal sim_s
            start = time.perf_counter()
            result = sim(index, groups)
            sim_s += time.perf_counter() - start
            return result

        start = time.perf_counter()
        verdict, rounds = run_check(nodes, run_round=timed_sim)
        analysis_ms.append((time.perf_counter() - start - sim_s) * 1000)
        rounds_used.append(len(rounds))
        blamed += len(verdict.faulty - faulty)
        missed += len(faulty - verdict.faulty)
        unresolved += len(verdict.unresolved)
        straggler_errors += len(verdict.stragglers ^ slow)
    return {
        "faulty_injected": len(scenario.faulty(nodes, random.Random(0))),
        "trials": trials,
        "rounds_max": max(rounds_used),
        "rounds_mean": round(statistics.fmean(rounds_used), 3),
        "rounds_goal": scenario.max_rounds_goal,
        "healthy_blamed": blamed,
        "faulty_missed": missed,
        "unresolved": unresolved,
        "straggler_errors": straggler_errors,
        "analysis_ms_median": round(statistics.median(analysis_ms), 3),
        "analysis_ms_max": round(max(analysis_ms), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    nodes = [f"node{i:03d}" for i in range(args.nodes)]
    results = {
        s.name: run_scenario(s, nodes=nodes, trials=args.trials, seed=args.seed) for s in SCENARIOS
    }
    ok = all(
        r["rounds_max"] <= r["rounds_goal"]
        and r["healthy_blamed"] == 0
        and r["faulty_missed"] == 0
        and r["unresolved"] == 0
        and r["straggler_errors"] == 0
        for r in results.values()
    )
    print(
        json.dumps(
            {
                "benchmark": "netcheck_sim",
                "nodes": args.nodes,
                "goals_met": ok,
                "scenarios": results,
            },
            sort_keys=True,
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
