"""A node whose link is cut is lost within seconds, not after the heartbeat timeout.

Real TCP, no mocks: a real ``MasterServer`` listens on the host side of a veth pair, a real
``MasterClient`` joins from a network namespace on the other side (a subprocess that heartbeats
as an agent does), then the node's side of the link goes down.  That blackholes the connection
both ways without a FIN or RST, as a pulled cable or a dead switch port does (this kernel has no
netem).  ``benchmarks/link_loss.py`` runs the same harness N times against the heartbeat-only
baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover_hpc.config import (
    DEFAULT_LINK_TIMEOUT_S,
    KEEPALIVE_LINK_TIMEOUT_S,
    MasterConfig,
    NodeRange,
)
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.nodes import NodeState
from dlrover_hpc.master.server import MasterServer
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.client import MasterClient
from dlrover_hpc.protocol.keepalive import LinkTimeouts, link_timeouts, unacknowledged_s

pytestmark = pytest.mark.timeout(120)

TOKEN = "link-loss-t0ken"
#: Keepalive off in effect: the baseline, where only the heartbeat timeout notices the cut.
NO_LINK_TIMEOUT_S = 10.0**6
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="network namespaces need root and iproute2",
)

# The agent's side, run inside the namespace: join, then heartbeat as dlrover-run does.
AGENT = r"""
import asyncio, sys
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.client import MasterClient

async def main(host, port, token, link_timeout_s):
    client = await MasterClient.connect(host, port, token=token, link_timeout_s=link_timeout_s)
    join = m.Join(node="cut-node", addr="cut-node", nproc=1)
    reply = await client.request(join, m.JoinReply, timeout_s=10)
    print("joined", reply.agent_id, flush=True)
    while True:
        beat = m.Heartbeat(agent_id=reply.agent_id, round=0)
        try:
            await client.request(beat, m.HeartbeatReply, timeout_s=3600)
        except (ConnectionError, TimeoutError) as exc:
            print("lost the master:", exc, flush=True)
            return
        print("beat", flush=True)
        await asyncio.sleep(reply.heartbeat_interval_s)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
"""


class _NoStores:
    """Rounds never complete here (2 nodes wanted, 1 joins): no torch store is ever made."""

    def ready(self) -> bool:
        return True

    def new_store(self, round: int) -> int:
        raise AssertionError("no round completes in this test")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    netns: str
    host_if: str  # host side of the veth pair (the master's)
    host_addr: str
    node_addr: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Detection:
    error_s: float | None  # cut -> the master's connection failed (None: it never did)
    lost_s: float  # cut -> the master marked the node lost
    reason: str  # of the node_lost event: "link timed out", "connection closed", "no heartbeat"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def veth_namespace() -> Iterator[Link]:
    """A network namespace joined to the host by a veth pair, on a random /30 of 10.213/16."""
    tag = secrets.token_hex(3)
    netns, host_if = f"linkloss-{tag}", f"ll{tag}h"
    third, fourth = secrets.randbelow(256), secrets.randbelow(64) * 4
    host_addr, node_addr = f"10.213.{third}.{fourth + 1}", f"10.213.{third}.{fourth + 2}"
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", netns, "addr", "add", f"{node_addr}/30", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        yield Link(netns=netns, host_if=host_if, host_addr=host_addr, node_addr=node_addr)
    finally:
        if Path(f"/sys/class/net/{host_if}").exists():
            subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        if Path(f"/run/netns/{netns}").exists():
            subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)


async def _line(proc: asyncio.subprocess.Process, prefix: str, timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        line = (await asyncio.wait_for(proc.stdout.readline(), left)).decode()
        if not line:
            break
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the agent in the namespace never printed {prefix!r}")


async def measure_detection(
    job_dir: Path,
    *,
    link_timeout_s: float = DEFAULT_LINK_TIMEOUT_S,
    heartbeat_timeout_s: float = 15.0,
    deadline_s: float = 60.0,
) -> Detection:
    """Join a node from a namespace, cut its link, time how long the master takes to lose it."""
    with veth_namespace() as link:
        config = MasterConfig(
            host=link.host_addr,
            port=0,
            nnodes=NodeRange.parse("2:2"),
            job_dir=str(job_dir),
            job_id="link-loss",
            heartbeat_timeout_s=heartbeat_timeout_s,
            link_timeout_s=link_timeout_s,
            requeue=False,
        )
        server = MasterServer(
            build_master(config, NoCluster(), job_dir=job_dir, stores=_NoStores()), token=TOKEN
        )
        port = await server.start()
        serving = asyncio.create_task(server.serve(linger_s=0))
        agent = await asyncio.create_subprocess_exec(
            *("ip", "netns", "exec", link.netns, sys.executable, "-c", AGENT),
            *(link.host_addr, str(port), TOKEN, repr(link_timeout_s)),
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            agent_id = (await _line(agent, "joined ", 30)).split()[1]
            await _line(agent, "beat", 30)  # one heartbeat through: the steady state
            rec = server.master.job.nodes[agent_id]
            cut = time.monotonic()
            _ip("-n", link.netns, "link", "set", "eth0", "down")  # the node's NIC goes dark
            while rec.state is not NodeState.LOST:
                assert time.monotonic() - cut < deadline_s, f"node not lost in {deadline_s} s"
                await asyncio.sleep(0.01)
            lost = time.monotonic() - cut
            error = None if rec.disconnected_at is None else rec.disconnected_at - cut
            lines = (job_dir / "events.jsonl").read_text().splitlines()
            (reason,) = [e["reason"] for e in map(json.loads, lines) if e["event"] == "node_lost"]
            return Detection(error_s=error, lost_s=lost, reason=reason)
        finally:
            with contextlib.suppress(ProcessLookupError):
                agent.kill()
            await agent.wait()
            server.master.job.request_stop("SIGTERM")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, 15)


# ------------------------------------------------------------------------------- tests
@needs_root
def test_cut_link_is_noticed_within_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("WARNING", logger="dlrover_hpc.master.server")
    found = asyncio.run(measure_detection(tmp_path))
    print(
        f"cut link: master's connection failed after {found.error_s:.2f} s, "
        f"node lost after {found.lost_s:.2f} s (link timeout {DEFAULT_LINK_TIMEOUT_S:g} s)"
    )
    assert found.reason == "link timed out", found
    # The master's ticks found the link silent (nothing acknowledged for the link timeout),
    # before the kernel's TCP_USER_TIMEOUT, which counts from the first retransmission.
    assert "link silent" in caplog.text, caplog.text
    # The connection fails and the node is lost as soon as the link has been silent for the
    # 1 s link timeout (no reconnect grace, no wait for the liveness tick), plus a tick
    # (0.1 s); with a second of slack for a loaded machine, far below the 15 s heartbeat
    # timeout.  The exact figures are benchmarks/link_loss.py's.
    assert found.error_s is not None and found.error_s < 2.5, found
    assert found.lost_s < 2.5, found


@needs_root
def test_unacknowledged_time_counts_from_the_last_acknowledgement() -> None:
    """``unacknowledged_s`` reads 0 on a healthy link with data flowing, and once the link is
    cut, the time since the peer's last acknowledgement, while the kernel (a 10 s
    TCP_USER_TIMEOUT here) still holds the connection."""
    peer = "import socket, sys\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
    peer += "while s.recv(4096): pass\n"
    with veth_namespace() as link, socket.create_server((link.host_addr, 0)) as listener:
        port = str(listener.getsockname()[1])
        argv = ["ip", "netns", "exec", link.netns, sys.executable, "-c", peer]
        proc = subprocess.Popen([*argv, link.host_addr, port])
        try:
            listener.settimeout(30)
            conn, _ = listener.accept()
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 10_000)
                healthy = []
                for _ in range(20):
                    conn.sendall(b"tick")
                    time.sleep(0.05)
                    healthy.append(unacknowledged_s(conn))
                assert all(v is not None and v < 0.5 for v in healthy), healthy
                _ip("-n", link.netns, "link", "set", "eth0", "down")
                cut = time.monotonic()
                seen = []
                while time.monotonic() - cut < 1.5:
                    conn.sendall(b"tick")
                    time.sleep(0.05)
                    seen.append((time.monotonic() - cut, unacknowledged_s(conn)))
                # Nothing acknowledged since just before the cut: the reading grows with the
                # time since it, to 1.5 s, and the kernel has not given up on the connection.
                readings = [v for _, v in seen if v is not None]
                assert len(readings) == len(seen), seen
                assert readings == sorted(readings), seen
                last_s, last = seen[-1][0], readings[-1]
                assert last_s - 0.5 <= last <= last_s + 0.5, seen
                conn.sendall(b"still open")  # no error: the 10 s user timeout is far off
        finally:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("link_timeout_s", "expected"),
    [
        (1.0, LinkTimeouts(idle_s=1, interval_s=1, count=1, user_timeout_ms=1000)),
        (3.0, LinkTimeouts(idle_s=1, interval_s=1, count=2, user_timeout_ms=3000)),
        (0.5, LinkTimeouts(idle_s=1, interval_s=1, count=1, user_timeout_ms=500)),
        (2.0, LinkTimeouts(idle_s=1, interval_s=1, count=1, user_timeout_ms=2000)),
        (10.0, LinkTimeouts(idle_s=3, interval_s=1, count=7, user_timeout_ms=10000)),
        (60.0, LinkTimeouts(idle_s=20, interval_s=6, count=7, user_timeout_ms=60000)),
        (
            NO_LINK_TIMEOUT_S,
            LinkTimeouts(idle_s=32767, interval_s=32767, count=30, user_timeout_ms=10**9),
        ),
    ],
)
def test_link_timeouts_table(link_timeout_s: float, expected: LinkTimeouts) -> None:
    got = link_timeouts(link_timeout_s)
    assert got == expected
    if link_timeout_s < NO_LINK_TIMEOUT_S:  # keepalive alone gives up within one interval
        assert link_timeout_s <= got.keepalive_s < max(link_timeout_s, 2) + got.interval_s


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_link_timeouts_rejects_non_positive(bad: float) -> None:
    with pytest.raises(ValueError, match="link timeout must be a positive number of seconds"):
        link_timeouts(bad)


def test_both_ends_set_keepalive_and_user_timeout(tmp_path: Path) -> None:
    """The accepted socket (master) and the client's socket (agent) carry the options."""
    tcp_options = ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")
    if not all(hasattr(socket, name) for name in tcp_options):
        pytest.skip("this platform lacks the Linux TCP keepalive options")

    def options(sock: socket.socket) -> tuple[int, ...]:
        tcp = socket.IPPROTO_TCP
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            *(sock.getsockopt(tcp, getattr(socket, name)) for name in tcp_options),
        )

    async def body() -> None:
        config = MasterConfig(
            host="127.0.0.1", port=0, job_dir=str(tmp_path), nnodes=NodeRange.parse("2:2")
        )
        server = MasterServer(
            build_master(config, NoCluster(), job_dir=tmp_path, stores=_NoStores()), token=TOKEN
        )
        port = await server.start()
        client = await MasterClient.connect("127.0.0.1", port, token=TOKEN, link_timeout_s=10.0)
        reply = await client.request(
            m.Join(node="n1", addr="n1", nproc=1), m.JoinReply, timeout_s=5
        )
        accepted = server._writers[reply.agent_id].get_extra_info("socket")
        assert options(accepted) == (1, 1, 1, 1, 1000)  # the master's default, 1 s
        assert options(client._writer.get_extra_info("socket")) == (1, 3, 1, 7, 10000)
        await client.close()
        await server.close()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["dlrover-hpc", "master", "--link-timeout=0"],
            "--link-timeout=0: must be a positive number of seconds, e.g. --link-timeout=1",
        ),
        (
            ["dlrover-run", "--link-timeout=-2", "train.py"],
            "--link-timeout=-2: must be a positive number of seconds, e.g. --link-timeout=1",
        ),
        (
            ["dlrover-hpc", "master", "--link-timeout=soon"],
            "argument --link-timeout: invalid float value: 'soon'",
        ),
    ],
)
def test_link_timeout_flag_is_checked(tmp_path: Path, argv: list[str], message: str) -> None:
    (tmp_path / "train.py").write_text("")
    exe = Path(sys.executable).with_name(argv[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLROVER_HPC_")}
    proc = subprocess.run(
        [str(exe), *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr  # one line (+ usage hint)


@pytest.mark.parametrize(
    ("link_timeout_s", "nodes", "tick_s"),
    [
        (1.0, "4", 0.1),  # a tenth of the timeout
        (1.0, "2:102", 0.1),
        (1.0, "2:200", 200 / 1024),  # 1,024 ticks a second: the most
        (1.0, "2:256", 0.25),  # a quarter of the timeout: the longest
        (1.0, "257", None),  # past it the keepalive probes alone
        (3.0, "768", 0.75),
        (3.0, "769", None),
        (0.5, "2:8", 0.05),
    ],
)
def test_link_ticks_stop_past_a_rate(
    link_timeout_s: float, nodes: str, tick_s: float | None
) -> None:
    config = MasterConfig(nnodes=NodeRange.parse(nodes), link_timeout_s=link_timeout_s)
    assert config.link_tick_s == tick_s


@pytest.mark.parametrize(
    ("link_timeout_s", "nodes", "in_use_s"),
    [
        (1.0, "2:256", 1.0),  # ticks keep data in flight: the flag's value
        (1.0, "257", KEEPALIVE_LINK_TIMEOUT_S),  # keepalive alone: two probes at least
        (1.0, "16384", KEEPALIVE_LINK_TIMEOUT_S),
        (2.0, "600", KEEPALIVE_LINK_TIMEOUT_S),
        (3.0, "768", 3.0),  # ticks again, at its own value
        (5.0, "16384", 5.0),  # longer than the floor: kept
    ],
)
def test_a_job_too_large_for_ticks_gets_a_longer_link_timeout(
    link_timeout_s: float, nodes: str, in_use_s: float
) -> None:
    config = MasterConfig(nnodes=NodeRange.parse(nodes), link_timeout_s=link_timeout_s)
    assert config.link_timeout_in_use_s == in_use_s


def test_a_large_jobs_link_timeout_is_on_both_ends(tmp_path: Path) -> None:
    """Past the ticks' rate, the master's accepted connections get the longer timeout from
    its listening socket, and an agent takes it from its JoinReply (a 1 s keepalive is one
    probe: 16,384 agents lost thousands of connections to probes dropped in a burst)."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        pytest.skip("this platform lacks TCP_USER_TIMEOUT")

    def user_timeout_ms(sock: socket.socket) -> int:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)

    async def body() -> None:
        config = MasterConfig(
            host="127.0.0.1", port=0, job_dir=str(tmp_path), nnodes=NodeRange.parse("2:4096")
        )
        server = MasterServer(
            build_master(config, NoCluster(), job_dir=tmp_path, stores=_NoStores()), token=TOKEN
        )
        port = await server.start()
        client = await MasterClient.connect("127.0.0.1", port, token=TOKEN)
        mine = client._writer.get_extra_info("socket")
        assert user_timeout_ms(mine) == DEFAULT_LINK_TIMEOUT_S * 1000
        reply = await client.request(
            m.Join(node="n1", addr="n1", nproc=1), m.JoinReply, timeout_s=5
        )
        assert reply.link_timeout_s == KEEPALIVE_LINK_TIMEOUT_S
        accepted = server._writers[reply.agent_id].get_extra_info("socket")
        assert user_timeout_ms(accepted) == KEEPALIVE_LINK_TIMEOUT_S * 1000
        client.set_link_timeout(reply.link_timeout_s)  # what the agent does with it
        assert user_timeout_ms(mine) == KEEPALIVE_LINK_TIMEOUT_S * 1000
        await client.close()
        await server.close()

    asyncio.run(body())


def test_master_ticks_its_agents_and_the_client_drops_the_ticks(tmp_path: Path) -> None:
    """Every agent connection gets a tick each ``link_tick_s`` (a cut link then always has data
    unacknowledged); the agent's client reads past them: no push, replies still matched."""

    async def body() -> None:
        config = MasterConfig(
            host="127.0.0.1", port=0, job_dir=str(tmp_path), nnodes=NodeRange.parse("3:3")
        )
        server = MasterServer(
            build_master(config, NoCluster(), job_dir=tmp_path, stores=_NoStores()), token=TOKEN
        )
        port = await server.start()
        serving = asyncio.create_task(server.serve(linger_s=0))
        # A raw agent: the handshake and a join by hand, then count what the master sends.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        challenge = await wire.read_frame(reader)
        digest = wire.auth_digest(TOKEN, challenge.body["nonce"])
        wire.write_frame(writer, wire.Frame(type="auth", body={"digest": digest}))
        assert (await wire.read_frame(reader)).type == "auth_ok"
        wire.write_frame(writer, m.to_frame(m.Join(node="raw", addr="raw", nproc=1), frame_id=1))
        assert (await wire.read_frame(reader)).type == m.JoinReply.TYPE
        client = await MasterClient.connect("127.0.0.1", port, token=TOKEN)
        join = asyncio.create_task(
            client.request(m.Join(node="n2", addr="n2", nproc=1), m.JoinReply, timeout_s=5)
        )
        started = time.monotonic()
        types = []
        while time.monotonic() - started < 1.2:
            types.append((await asyncio.wait_for(wire.read_frame(reader), 1.0)).type)
        assert set(types) == {m.LinkTick.TYPE}, types
        assert config.link_tick_s == pytest.approx(0.1)
        assert 7 <= len(types) <= 14, types  # every 0.1 s (0.25 s would be 4-5)
        assert not join.done() or join.exception() is None
        assert client.pushes.empty()  # the ticks it read were dropped, not queued
        writer.close()
        join.cancel()
        await client.close()
        server.master.job.request_stop("SIGTERM")
        await asyncio.wait_for(serving, 15)

    asyncio.run(body())
