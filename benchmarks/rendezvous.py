"""Rendezvous of N simulated agents (asyncio clients in one process) against a real master.

Prints one JSON line.  The baseline, measured in the same run, is the floor of the transport:
N connections to a plain asyncio server that answers one length-prefixed frame each.

    python benchmarks/rendezvous.py --agents 64 1024 8192 16384
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from dlrover_hpc.config import DEFAULT_LINK_TIMEOUT_S
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.client import MasterClient
from dlrover_hpc.protocol.loop import loop_factory, name

GOALS_S = {1024: 2.0, 8192: 15.0, 16384: 5.0}  # 16,384: issue 29


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


async def _agent(port: int, token: str, i: int, sem: asyncio.Semaphore) -> tuple[int, MasterClient]:
    async with sem:  # bounded concurrent connects, as a real fan-in would be
        # The link timeout once, the master's (an agent sets its own, then the master's).
        client = await MasterClient.connect(
            "127.0.0.1", port, token=token, timeout_s=120, link_timeout_s=None
        )
        reply = await client.request(
            m.Join(node=f"node{i:05d}", addr=f"node{i:05d}", nproc=8, slurm_node_id=i),
            m.JoinReply,
            timeout_s=120,
        )
        client.set_link_timeout(max(reply.link_timeout_s, DEFAULT_LINK_TIMEOUT_S))
    assignment = await client.request(
        m.WaitRound(agent_id=reply.agent_id, after_round=0), m.Assignment, timeout_s=300
    )
    return assignment.node_rank, client


async def rendezvous(n: int, port: int, token: str) -> float:
    sem = asyncio.Semaphore(512)
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_agent(port, token, i, sem) for i in range(n)])
    took = time.perf_counter() - t0
    ranks = sorted(r for r, _ in results)
    assert ranks == list(range(n)), "every agent must get a distinct node rank"
    await asyncio.gather(*[c.close() for _, c in results])
    return took


#: The baseline's server, in a process of its own: each side of N connections holds N files,
#: and one process holding both ran out of them at 16,384 agents ("Too many open files").
_BASELINE_SERVER = """
import asyncio, resource, sys
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.loop import loop_factory  # the master's loop

async def serve(reader, writer):
    frame = await wire.read_frame(reader)
    wire.write_frame(writer, wire.Frame(type="ok", id=frame.id))
    await writer.drain()
    try:
        await reader.read()  # hold the connection until the client closes it
    except (asyncio.CancelledError, ConnectionError):
        pass  # this server is shutting down
    writer.close()

async def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=4096)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)

with asyncio.Runner(loop_factory=loop_factory()) as runner:
    runner.run(main())
"""


async def baseline(n: int) -> float:
    """N connections, one framed request and answer each: the transport's floor."""
    server = subprocess.Popen(
        [sys.executable, "-c", _BASELINE_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        sem = asyncio.Semaphore(512)

        async def one(i: int) -> asyncio.StreamWriter:
            async with sem:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                wire.write_frame(writer, wire.Frame(type="ping", id=i))
                await writer.drain()
                await wire.read_frame(reader)
            return writer

        t0 = time.perf_counter()
        writers = await asyncio.gather(*[one(i) for i in range(n)])
        took = time.perf_counter() - t0
        for w in writers:
            w.close()
        return took
    finally:
        server.communicate("", timeout=60)


def _run(coro: Coroutine[Any, Any, float]) -> float:
    """The simulated agents' side on the master's loop (uvloop where installed): the agents'
    process shares the two cores with the master, and its cost is the harness's, not ours."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(coro)


def _cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_idle(pid: int, *, timeout_s: float = 60.0) -> None:
    """Until the master is idle: listening, and done importing torch in the background (a
    job's agents reach their master seconds after it starts, once srun has started them)."""
    deadline = time.monotonic() + timeout_s
    before = _cpu_s(pid)
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _cpu_s(pid)
        if now - before < 0.02:
            return
        before = now
    raise RuntimeError(f"the master (pid {pid}) did not settle in {timeout_s:g} s")


def run_one(n: int) -> dict:
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as job_dir:
        env = {**os.environ, "DLROVER_HPC_TOKEN": token, "DLROVER_HPC_LOG_LEVEL": "WARNING"}
        master = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dlrover_hpc.cli.main",
                "master",
                "--host=127.0.0.1",
                "--port=0",
                f"--nnodes={n}:{n}",
                f"--job-dir={job_dir}",
                "--last-call=0",
                "--heartbeat-timeout=600",
            ],
            env=env,
        )
        try:
            info_path = Path(job_dir) / "master.json"
            deadline = time.monotonic() + 60
            while not info_path.exists():
                if time.monotonic() > deadline or master.poll() is not None:
                    raise RuntimeError("master did not start")
                time.sleep(0.05)
            port = json.loads(info_path.read_text())["port"]
            _wait_idle(master.pid)
            cpu_before, fleet_before = _cpu_s(master.pid), _cpu_s(os.getpid())
            took = _run(rendezvous(n, port, token))
            master_cpu = _cpu_s(master.pid) - cpu_before
            fleet_cpu = _cpu_s(os.getpid()) - fleet_before
        finally:
            master.terminate()
            master.wait(30)
    base = _run(baseline(n))
    return {
        "agents": n,
        "rendezvous_s": round(took, 3),
        "baseline_transport_s": round(base, 3),
        "ratio_to_transport": round(took / base, 2),
        "master_cpu_s": round(master_cpu, 3),  # the master's own share of the rendezvous
        "agents_cpu_s": round(fleet_cpu, 3),  # the simulated agents' (this process)
        "goal_s": GOALS_S.get(n),
        "meets_goal": took <= GOALS_S[n] if n in GOALS_S else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--agents", type=int, nargs="+", default=[64, 1024, 8192])
    args = p.parse_args()
    _raise_fd_limit(max(args.agents) + 512)  # the agents' side; master and server: their own
    results = [run_one(n) for n in args.agents]
    loop = name(loop_factory())  # the master's and the baseline server's
    print(
        json.dumps(
            {"bench": "rendezvous", "cpus": os.cpu_count(), "event_loop": loop, "results": results}
        )
    )


if __name__ == "__main__":
    main()
