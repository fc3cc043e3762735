"""The agent's master link across dropped connections, against a real master over real TCP.

A small TCP relay sits between the agent side and the master so the test can drop every
connection (as a reset or a link that came back does) and refuse new ones for a while.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from pathlib import Path

import pytest

from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.thread import MasterThread
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient


class Relay:
    """Forwards 127.0.0.1:port to the master; ``drop`` closes every connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.writers: list[asyncio.StreamWriter] = []
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop_listening(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    def drop(self) -> None:
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers += [writer, up_w]

        async def copy(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.transport.abort()

        await asyncio.gather(copy(reader, up_w), copy(up_r, writer))


@pytest.fixture
def master(tmp_path: Path):  # type: ignore[no-untyped-def]
    token = secrets.token_hex(16)
    cfg = MasterConfig(host="127.0.0.1", port=0, nnodes=NodeRange(min=1, max=1), job_id="t")
    thread = MasterThread(cfg, token=token, job_dir=tmp_path, cluster=NoCluster())
    port = thread.start()
    yield thread, port, token
    thread.server.master.job.request_stop("SIGTERM")
    thread.join(timeout_s=10)


def _link(relay: Relay, token: str, joins: list[str], timeout_s: float) -> MasterLink:
    agent_id: list[str] = []

    async def connect(pushes: asyncio.Queue[m.Message]) -> MasterClient:
        return await MasterClient.connect(
            "127.0.0.1", relay.port, token=token, pushes=pushes, timeout_s=2
        )

    async def register(client: MasterClient) -> None:
        join = m.Join(node="n1", addr="n1", nproc=1, agent_id=agent_id[0] if agent_id else None)
        reply = await client.request(join, m.JoinReply, timeout_s=5)
        agent_id[:] = [reply.agent_id]
        joins.append(reply.agent_id)

    return MasterLink(connect, register, reconnect_timeout_s=timeout_s)


def _run(body: Callable[[], object]) -> None:
    asyncio.run(body())  # type: ignore[arg-type]


def test_dropped_connection_is_remade_under_the_same_agent_id(master) -> None:  # type: ignore[no-untyped-def]
    thread, port, token = master

    async def body() -> None:
        relay = Relay(port)
        await relay.start()
        joins: list[str] = []
        link = _link(relay, token, joins, timeout_s=30)
        await link.open()
        beat = m.Heartbeat(agent_id=joins[0], round=0)
        assert (await link.request(beat, m.HeartbeatReply, timeout_s=5)).finished is False
        first = link.client
        relay.drop()
        # sent while the connection is down: waits for the new one and goes through
        reply = await link.request(beat, m.HeartbeatReply, timeout_s=10)
        assert reply.finished is False
        assert link.client is not first and link.reconnects == 1
        assert joins == [joins[0], joins[0]]  # re-registered, same id
        assert list(thread.server.master.job.nodes) == [joins[0]]  # one record, not two
        await link.close()

    _run(body)


def test_requests_wait_while_the_master_refuses_then_go_through(master) -> None:  # type: ignore[no-untyped-def]
    _thread, port, token = master

    async def body() -> None:
        relay = Relay(port)
        await relay.start()
        joins: list[str] = []
        link = _link(relay, token, joins, timeout_s=30)
        await link.open()
        await relay.stop_listening()
        relay.drop()  # connection refused from now on, as while a master restarts
        beat = asyncio.create_task(
            link.request(m.Heartbeat(agent_id=joins[0], round=0), m.HeartbeatReply, timeout_s=20)
        )
        await asyncio.sleep(1.5)
        assert not beat.done() and not link.gone.is_set()
        await relay.start(relay.port)  # listening again on the same port
        assert (await beat).finished is False
        assert link.reconnects == 1
        await link.close()

    _run(body)


def test_the_link_gives_up_after_the_reconnect_timeout(master) -> None:  # type: ignore[no-untyped-def]
    _thread, port, token = master

    async def body() -> None:
        relay = Relay(port)
        await relay.start()
        joins: list[str] = []
        link = _link(relay, token, joins, timeout_s=1.0)
        await link.open()
        await relay.stop_listening()
        relay.drop()
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ConnectionError, match="gone"):
            await link.request(
                m.Heartbeat(agent_id=joins[0], round=0), m.HeartbeatReply, timeout_s=30
            )
        assert link.gone.is_set() and loop.time() - started < 5
        await link.close()

    _run(body)
