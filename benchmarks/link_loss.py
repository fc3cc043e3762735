"""How long the master takes to lose a node whose link is cut (root: network namespaces).

Each run joins one agent from a network namespace, takes the node's side of its veth down (no
FIN, no RST: a blackhole) and times the master until the node is lost.  The baseline, measured
in the same run, is the same cut with the fast detection off in effect (a huge
``--link-timeout``), where only the heartbeat timeout notices it.  Prints one JSON line.

    python benchmarks/link_loss.py --runs 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the harness lives in tests/

from dlrover_hpc.config import DEFAULT_LINK_TIMEOUT_S
from tests.protocol.test_link_loss import (
    NO_LINK_TIMEOUT_S,
    Detection,
    measure_detection,
)


async def _runs(runs: int, link_timeout_s: float, heartbeat_timeout_s: float) -> list[Detection]:
    found = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="link-loss-") as job_dir:  # no journal resume
            found.append(
                await measure_detection(
                    Path(job_dir),
                    link_timeout_s=link_timeout_s,
                    heartbeat_timeout_s=heartbeat_timeout_s,
                )
            )
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--link-timeout", type=float, default=DEFAULT_LINK_TIMEOUT_S)
    p.add_argument("--heartbeat-timeout", type=float, default=15.0)
    p.add_argument("--baseline-runs", type=int, default=None, help="default: --runs")
    args = p.parse_args()
    fast = asyncio.run(_runs(args.runs, args.link_timeout, args.heartbeat_timeout))
    base = asyncio.run(
        _runs(args.baseline_runs or args.runs, NO_LINK_TIMEOUT_S, args.heartbeat_timeout)
    )
    lost, errors = [d.lost_s for d in fast], [d.error_s for d in fast if d.error_s is not None]
    print(
        json.dumps(
            {
                "detect_s_median": round(statistics.median(lost), 2),
                "detect_s_max": round(max(lost), 2),
                "connection_error_s_median": round(statistics.median(errors), 2)
                if errors
                else None,
                "connection_error_s_max": round(max(errors), 2) if errors else None,
                "link_timeout_s": args.link_timeout,
                "heartbeat_timeout_s": args.heartbeat_timeout,
                "baseline_detect_s_median": round(statistics.median(d.lost_s for d in base), 2),
                "baseline_detect_s_max": round(max(d.lost_s for d in base), 2),
                "reasons": sorted({d.reason for d in fast}),
                "baseline_reasons": sorted({d.reason for d in base}),
                "runs": len(fast),
            }
        )
    )


if __name__ == "__main__":
    main()
