"""Rendezvous of N simulated agents (asyncio clients in one process) against a real master.

Prints one JSON line.  The baseline, measured in the same run, is the floor of the transport:
N connections to a plain asyncio server that answers one length-prefixed frame each.

    python benchmarks/rendezvous.py --agents 64 1024 8192 16384
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import secrets
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from local_master import start_master

from dlrover_hpc.config import DEFAULT_LINK_TIMEOUT_S
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.client import MasterClient
from dlrover_hpc.protocol.keepalive import set_link_timeout
from dlrover_hpc.protocol.loop import loop_factory, name

_HEADER = struct.Struct(">I")

GOALS_S = {1024: 2.0, 8192: 15.0, 16384: 5.0}  # 16,384: issue 29


def _raise_fd_limit(need: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))


async def _agent(port: int, token: str, i: int, sem: asyncio.Semaphore) -> tuple[int, Any]:
    """One agent on the real client (``--streams``): what dlrover-run's agent runs."""
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


class _Frames(asyncio.Protocol):
    """Length-prefixed frames off a connection, parsed in ``data_received``: a simulated agent
    without a stream reader, a read task and a future per request (the real client's cost is
    the agents', one per node, not the master's)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while len(self._buf) >= 4:
            (length,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < 4 + length:
                return
            frame = wire.decode(bytes(self._buf[4 : 4 + length]))
            del self._buf[: 4 + length]
            self.frame(frame)

    def send(self, frame: wire.Frame) -> None:
        assert self.transport is not None
        self.transport.write(wire.encode(frame))

    def frame(self, frame: wire.Frame) -> None:
        raise NotImplementedError


class _LeanAgent(_Frames):
    """An agent's rendezvous on the real wire: the HMAC handshake, Join, WaitRound."""

    def __init__(self, i: int, token: str, joined: asyncio.Future, ranked: asyncio.Future):
        super().__init__()
        self.i, self.token, self.joined, self.ranked = i, token, joined, ranked

    def frame(self, frame: wire.Frame) -> None:
        if frame.type == "challenge":
            digest = wire.auth_digest(self.token, frame.body["nonce"])
            self.send(wire.Frame(type="auth", body={"digest": digest}))
        elif frame.type == "auth_ok":
            node = f"node{self.i:05d}"
            join = m.Join(node=node, addr=node, nproc=8, slurm_node_id=self.i)
            self.send(m.to_frame(join, frame_id=1))
        elif frame.type == m.JoinReply.TYPE:
            reply = m.from_frame(frame)
            assert isinstance(reply, m.JoinReply)
            sock = self.transport.get_extra_info("socket") if self.transport else None
            set_link_timeout(sock, max(reply.link_timeout_s, DEFAULT_LINK_TIMEOUT_S))
            self.send(m.to_frame(m.WaitRound(agent_id=reply.agent_id, after_round=0), frame_id=2))
            self.joined.set_result(None)
        elif frame.type == m.Assignment.TYPE and not self.ranked.done():
            assignment = m.from_frame(frame)
            assert isinstance(assignment, m.Assignment)
            self.ranked.set_result(assignment.node_rank)
        elif frame.type != m.LinkTick.TYPE:
            raise AssertionError(f"agent {self.i}: unexpected {frame.type!r}: {frame.body}")

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.joined, self.ranked):
            if not fut.done():
                fut.set_exception(ConnectionError(f"agent {self.i}: connection lost: {exc}"))


#: Linux's IP_BIND_ADDRESS_NO_PORT (not in Python's socket module): the port is chosen at
#: connect, for the whole 4-tuple.
_IP_BIND_ADDRESS_NO_PORT = 24


async def _connect(i: int, port: int, factory: Callable[[], asyncio.Protocol]) -> Any:
    """Agent ``i``'s connection to 127.0.0.1:``port`` from an address of its own in 127/8, 250
    agents an address, as agents on their own nodes connect: from one address, 16,384
    connections spend most of the ephemeral ports, and the kernel's search for a free one
    made the agents' side quadratic (3 s of system time at 16,384, 0.7 s at 8,192)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((f"127.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}", 0))
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    transport, _ = await loop.create_connection(factory, sock=sock)
    return transport


async def _lean_agent(port: int, token: str, i: int, sem: asyncio.Semaphore) -> tuple[int, Any]:
    loop = asyncio.get_running_loop()
    joined, ranked = loop.create_future(), loop.create_future()
    async with sem:  # bounded concurrent joins, as a real fan-in would be
        transport = await _connect(i, port, lambda: _LeanAgent(i, token, joined, ranked))
        await joined
    return await ranked, transport


async def rendezvous(n: int, port: int, token: str, *, streams: bool) -> float:
    sem = asyncio.Semaphore(512)
    agent = _agent if streams else _lean_agent
    t0 = time.perf_counter()
    results = await asyncio.gather(*[agent(port, token, i, sem) for i in range(n)])
    took = time.perf_counter() - t0
    ranks = sorted(r for r, _ in results)
    assert ranks == list(range(n)), "every agent must get a distinct node rank"
    for _, conn in results:
        conn.close()
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


class _Ping(_Frames):
    def __init__(self, answered: asyncio.Future) -> None:
        super().__init__()
        self.answered = answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.send(wire.Frame(type="ping", id=1))

    def frame(self, frame: wire.Frame) -> None:
        self.answered.set_result(None)


async def baseline(n: int, *, streams: bool) -> float:
    """N connections, one framed request and answer each: the transport's floor, on the
    agents' client (``streams``: asyncio's streams, else the lean protocol)."""
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

        async def one(i: int) -> Any:
            async with sem:
                if not streams:
                    answered = asyncio.get_running_loop().create_future()
                    transport = await _connect(i, port, lambda: _Ping(answered))
                    await answered
                    return transport
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
    gc.disable()  # the harness's own garbage: 16,384 agents' objects, scanned again and again
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(coro)
    finally:
        gc.enable()


def _cpu_s(pid: int, *, system: bool = False) -> float:
    """The CPU seconds (user and system; ``system``: the kernel's only) ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[12]) + (0 if system else int(fields[11]))
    return ticks / os.sysconf("SC_CLK_TCK")


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


def run_one(n: int, *, streams: bool) -> dict:
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as job_dir:
        master, port = start_master(
            job_dir, token, f"--nnodes={n}:{n}", "--last-call=0", "--heartbeat-timeout=600"
        )
        try:
            _wait_idle(master.pid)
            cpu_before, fleet_before = _cpu_s(master.pid), _cpu_s(os.getpid())
            sys_before = _cpu_s(master.pid, system=True), _cpu_s(os.getpid(), system=True)
            took = _run(rendezvous(n, port, token, streams=streams))
            master_cpu = _cpu_s(master.pid) - cpu_before
            fleet_cpu = _cpu_s(os.getpid()) - fleet_before
            master_sys = _cpu_s(master.pid, system=True) - sys_before[0]
            fleet_sys = _cpu_s(os.getpid(), system=True) - sys_before[1]
        finally:
            master.terminate()
            master.wait(30)
    base = _run(baseline(n, streams=streams))
    return {
        "agents": n,
        "rendezvous_s": round(took, 3),
        "baseline_transport_s": round(base, 3),
        "ratio_to_transport": round(took / base, 2),
        "master_cpu_s": round(master_cpu, 3),  # the master's own share of the rendezvous
        "agents_cpu_s": round(fleet_cpu, 3),  # the simulated agents' (this process)
        "master_kernel_s": round(master_sys, 3),  # of which in the kernel (TCP, epoll)
        "agents_kernel_s": round(fleet_sys, 3),
        "goal_s": GOALS_S.get(n),
        "meets_goal": took <= GOALS_S[n] if n in GOALS_S else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--agents", type=int, nargs="+", default=[64, 1024, 8192])
    p.add_argument(
        "--streams",
        action="store_true",
        help="simulate the agents with the agents' real client (asyncio streams, a read task "
        "each): the rendezvous is then bound by the simulation's own CPU on this machine",
    )
    args = p.parse_args()
    _raise_fd_limit(max(args.agents) + 512)  # the agents' side; master and server: their own
    results = [run_one(n, streams=args.streams) for n in args.agents]
    loop = name(loop_factory())  # the master's and the baseline server's
    print(
        json.dumps(
            {
                "bench": "rendezvous",
                "cpus": os.cpu_count(),
                "event_loop": loop,
                "agents_client": "streams" if args.streams else "protocol",
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
