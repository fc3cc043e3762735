"""What each health check before joining costs a node (issue 48, item 1).

Runs every check of :mod:`dlrover_hpc.agent.health` ``--repeat`` times, as an agent runs them
before it joins a round, against real things: /dev/shm with a checkpoint's segments in it
(``--ckpt-mib``, both buffers of one rank, each holding a complete step that names the
checkpoint directory), a write+fsync+remove in ``--ckpt-dir`` (default: a
fresh directory under the current one, the file system a job's checkpoints go to), the clock
against a real ``dlrover-hpc master`` on 127.0.0.1 over the real wire (its round trip), the GPU
check as it runs here (NVML: skipped without ``nvidia-ml-py`` or GPUs), and the site program
``/bin/true`` (a fork and exec: the floor under any ``--health-check``).  Also the whole of
:meth:`NodeHealth.check` with all of them, against the 5 s budget of the built-in ones.

Prints one JSON line: per check the median and p90 in milliseconds, and its status here.

    python benchmarks/health_check.py --repeat 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from local_master import start_master  # noqa: E402

from dlrover_hpc.agent import health  # noqa: E402
from dlrover_hpc.agent import health_rules as rules  # noqa: E402
from dlrover_hpc.checkpoint.env import segment_name  # noqa: E402
from dlrover_hpc.checkpoint.saver.segments import Segment  # noqa: E402
from dlrover_hpc.protocol import messages as m  # noqa: E402
from dlrover_hpc.protocol.client import MasterClient  # noqa: E402


def _stats(ms: list[float]) -> dict[str, float]:
    ordered = sorted(ms)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
    }


async def measure(args: argparse.Namespace, port: int, token: str, ckpt_dir: str) -> dict:
    client = await MasterClient.connect("127.0.0.1", port, token=token, link_timeout_s=5.0)

    async def master_clock() -> tuple[float | None, str]:
        reply = await client.request(m.ClockRequest(), m.ClockReply, timeout_s=2)
        return reply.time, ""

    prefix = f"dlrover-hpc-bench-{os.getpid()}-node-"
    segments = [Path(args.shm_dir) / segment_name(prefix, rank=0, buffer=b) for b in (0, 1)]
    meta = json.dumps({"step": 1, "ckpt_dir": ckpt_dir, "part": None}).encode()
    for path in segments:  # a complete step in each, as a worker's save leaves it
        seg = Segment(str(path), writable=True)
        try:
            seg.ensure_size(args.ckpt_mib * 2**20)
            seg.finish_write(seq=seg.begin_write(), step=1, image_len=4096, meta=meta)
        finally:
            seg.close()
    node = health.NodeHealth(node="bench", program="/bin/true", shm_dir=args.shm_dir)
    checks = {
        "shm": lambda: node.shm(prefix),
        "storage_fsync": lambda: health.storage_reading(ckpt_dir, "bench", 5.0),
        "clock": lambda: health.clock_reading(master_clock, 5.0),
        "nvml": lambda: health.gpu_reading(0, 5.0, health.load_nvml),
        "program_bin_true": lambda: health.run_program(("/bin/true",), 60.0),
    }
    out: dict[str, dict] = {}
    try:
        for name, make in checks.items():
            ms, status, reason = [], "", ""
            for _ in range(args.repeat):
                r = await health.timed(make)
                ms.append(r.ms)
                status, reason = r.status.value, r.reason
            out[name] = {**_stats(ms), "status": status, **({"why": reason} if reason else {})}
        whole = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            results = await node.check(segment_prefix=prefix, master_clock=master_clock)
            whole.append((time.perf_counter() - began) * 1000)
            assert rules.verdict(results) is None, [r.line() for r in results]
            # the directory came from the segments' step, as on a node that never persisted
            assert [r.status.value for r in results[:2]] == ["ok", "ok"], results
        out["all_checks"] = {**_stats(whole), "budget_ms": rules.BUILTIN_BUDGET_S * 1000}
    finally:
        for seg in segments:
            seg.unlink(missing_ok=True)
        await client.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--ckpt-dir", default=None, help="where the fsync probe writes (default: ./)")
    p.add_argument("--ckpt-mib", type=int, default=64, help="size of each checkpoint segment")
    p.add_argument("--shm-dir", default="/dev/shm")
    args = p.parse_args()
    token = secrets.token_hex(16)
    with (
        tempfile.TemporaryDirectory() as job_dir,
        tempfile.TemporaryDirectory(
            dir=args.ckpt_dir or os.getcwd(), prefix=".health-bench-"
        ) as ckpt_dir,
    ):
        master, port = start_master(job_dir, token, "--nnodes=1:1")
        try:
            checks = asyncio.run(measure(args, port, token, ckpt_dir))
        finally:
            master.terminate()
            master.wait(30)
    print(
        json.dumps(
            {
                "benchmark": "health_check",
                "repeat": args.repeat,
                "ckpt_dir": args.ckpt_dir or os.getcwd(),
                "checks": checks,
            }
        )
    )


if __name__ == "__main__":
    main()
