"""The master's wire: framing, HMAC authentication, typed messages, over real loopback TCP."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlrover_hpc.config import HEARTBEATS_PER_S, MasterConfig, NodeRange
from dlrover_hpc.errors import AuthError, ProtocolError
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.server import GC_THRESHOLDS, MasterServer
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.client import MasterClient

TOKEN = "t0ken-for-tests"


class FakeStores:
    """A fake of our StoreFactory: hands out made-up ports instead of torch TCPStores."""

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def ready(self) -> bool:
        return True

    def new_store(self, round: int) -> int:
        self.rounds.append(round)
        return 40000 + round


def _server(tmp_path: Path, nnodes: str = "2:2") -> MasterServer:
    cfg = MasterConfig(
        host="127.0.0.1",
        port=0,
        nnodes=NodeRange.parse(nnodes),
        job_dir=str(tmp_path),
        job_id="77",
        last_call_s=0.2,
    )
    return MasterServer(
        build_master(cfg, NoCluster(), job_dir=tmp_path, stores=FakeStores()), token=TOKEN
    )


def test_frame_round_trip_and_bad_frames() -> None:
    frame = wire.Frame(type="join", id=5, body={"node": "n1"})
    data = wire.encode(frame)
    assert struct.unpack(">I", data[:4])[0] == len(data) - 4
    assert wire.decode(data[4:]) == frame
    with pytest.raises(ProtocolError, match=r"unsupported protocol version 2; this side speaks 1"):
        wire.decode(b'{"v":2,"type":"join","id":1,"body":{}}')
    with pytest.raises(ProtocolError, match="frame is not JSON"):
        wire.decode(b"\x80\x03pickle")
    with pytest.raises(ProtocolError, match="frame is not JSON"):
        wire.decode(b"[" * 100_000)
    # What the fast decoder refuses and json reads, reads as before: NaN, a 100-bit integer.
    odd = wire.decode(
        b'{"v":1,"type":"t","id":1,"body":{"x":NaN,"n":1267650600228229401496703205376}}'
    )
    assert odd.body["x"] != odd.body["x"] and odd.body["n"] == 2**100
    with pytest.raises(ProtocolError, match="unknown message type 'bogus'"):
        m.from_frame(wire.Frame(type="bogus"))
    with pytest.raises(ProtocolError, match=r"join\.nproc: 'two' does not match"):
        m.from_frame(wire.Frame(type="join", body={"node": "a", "addr": "a", "nproc": "two"}))
    with pytest.raises(ProtocolError, match=r"join: unknown fields \['evil'\]"):
        m.from_frame(
            wire.Frame(type="join", body={"node": "a", "addr": "a", "nproc": 1, "evil": 1})
        )


def test_a_heartbeats_progress_rows_are_checked_field_by_field() -> None:
    row = m.RankProgress(rank=3, step=7, stalled_s=0.5, at=1e9, saved_step=5)
    beat = m.Heartbeat(agent_id="n1-1", round=2, progress=[row, row], rtt_s=0.001)
    frame = wire.decode(wire.encode(m.to_frame(beat, frame_id=9))[4:])
    assert m.from_frame(frame) == beat
    names = [f.name for f in dataclasses.fields(m.RankProgress)]
    good = frame.body["progress"][0]
    assert good == [getattr(row, n) for n in names]  # sent as an array, in field order
    as_object = dict(zip(names, good, strict=True))  # an object with the same fields is read
    by_object = wire.Frame(type="heartbeat", body={**frame.body, "progress": [as_object]})
    assert m.from_frame(by_object).progress == [row]

    def with_row(**change: object) -> wire.Frame:
        bad = {k: v for k, v in {**as_object, **change}.items() if v is not ...}
        return wire.Frame(type="heartbeat", body={**frame.body, "progress": [as_object, bad]})

    def with_array(**change: object) -> wire.Frame:
        bad = [change.get(n, v) for n, v in as_object.items()]
        return wire.Frame(type="heartbeat", body={**frame.body, "progress": [good, bad]})

    wrong_types = (
        {"step": "7"},
        {"step": True},
        {"stalled_s": None},
        {"rank": 3.5},
        {"section": 5},
    )
    for change in (
        *wrong_types,  # a string or a bool for an int, None for a float, a float for an int...
        {"evil": 1},  # a field the row does not have
        {"step": ...},  # a field missing
    ):
        with pytest.raises(ProtocolError, match=r"heartbeat\.progress: .* does not match"):
            m.from_frame(with_row(**change))
    for change in wrong_types:
        with pytest.raises(ProtocolError, match=r"heartbeat\.progress: .* does not match"):
            m.from_frame(with_array(**change))
    for length in (len(good) - 1, len(good) + 1):  # a value missing, or one too many
        bad = [*good, 0][:length]
        frame_of = wire.Frame(type="heartbeat", body={**frame.body, "progress": [bad]})
        with pytest.raises(ProtocolError, match=r"heartbeat\.progress: .* does not match"):
            m.from_frame(frame_of)
    assert m.from_frame(with_row(stalled_s=1)).progress[1].stalled_s == 1  # an int for a float
    assert m.from_frame(with_array(stalled_s=1)).progress[1].stalled_s == 1
    with pytest.raises(ProtocolError, match=r"heartbeat\.progress"):
        m.from_frame(wire.Frame(type="heartbeat", body={**frame.body, "progress": good}))
    # Rows of a class not sent as arrays (a status reply's nodes: `status --json`) are objects.
    node = m.NodeRow(agent_id="n1-1", node="n1", rank=0, state=m.NodeState.ACTIVE, round=1, nproc=2)
    status = m.StatusReply(
        job_id="j", state="running", round=1, restart_count=0, max_restarts=3, nodes=[node]
    )
    sent = wire.decode(wire.encode(m.to_frame(status))[4:])
    assert sent.body["nodes"] == [{**dataclasses.asdict(node), "state": "active"}]
    assert m.from_frame(sent) == status
    as_array = [list(sent.body["nodes"][0].values())]
    with pytest.raises(ProtocolError, match=r"status_reply\.nodes: .* does not match"):
        m.from_frame(wire.Frame(type="status_reply", body={**sent.body, "nodes": as_array}))


def test_client_with_wrong_token_is_refused_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        server = _server(tmp_path)
        port = await server.start()
        with pytest.raises(AuthError, match="refused the job token"):
            await MasterClient.connect("127.0.0.1", port, token="wrong")
        # A client that ignores the challenge and sends a request is cut off, never served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        challenge = await wire.read_frame(reader)
        assert challenge.type == "challenge"
        wire.write_frame(writer, m.to_frame(m.StatusRequest(), frame_id=1))
        await writer.drain()
        answer = await wire.read_frame(reader)
        assert answer.type == "auth_failed"
        with pytest.raises(EOFError):
            await wire.read_frame(reader)
        writer.close()
        assert not server.master.job.nodes
        await server.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(body())
    assert "reason=bad job token" in caplog.text


def test_a_master_that_closes_before_its_challenge_is_a_connection_error() -> None:
    # A master ending (or restarting) accepts and closes: `status --watch` and the agents
    # handle an OSError, as for a refused connection; an EOFError escaped them as a traceback.
    async def body() -> None:
        async def close_at_once(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(ConnectionResetError, match="closed the connection before"):
            await MasterClient.connect("127.0.0.1", port, token="t")
        server.close()
        await server.wait_closed()

    asyncio.run(body())


def test_join_rendezvous_status_and_error_reply(tmp_path: Path) -> None:
    async def body() -> None:
        server = _server(tmp_path)
        port = await server.start()
        job = asyncio.create_task(server.master.job.run())
        clients = [await MasterClient.connect("127.0.0.1", port, token=TOKEN) for _ in range(2)]
        ids = []
        for i, c in enumerate(clients):
            reply = await c.request(
                m.Join(node=f"node{i + 1}", addr=f"node{i + 1}", nproc=2), m.JoinReply, timeout_s=5
            )
            ids.append(reply.agent_id)
        waits = [
            c.request(m.WaitRound(agent_id=a, after_round=0), m.Assignment, timeout_s=10)
            for c, a in zip(clients, ids, strict=True)
        ]
        a1, a2 = await asyncio.gather(*waits)
        assert (a1.node_rank, a2.node_rank) == (0, 1)
        assert (a1.world_size, a2.rank_offset, a1.store_port) == (4, 2, 40001)
        status = await clients[0].request(m.StatusRequest(), m.StatusReply, timeout_s=5)
        assert status.state == "running" and [n.state for n in status.nodes] == ["active"] * 2
        # A message the master does not serve gets an error reply, never an empty success.
        with pytest.raises(ProtocolError, match="'ack' is not a request the master serves"):
            await clients[0].request(m.Ack(), m.Ack, timeout_s=5)
        with pytest.raises(ProtocolError, match="unknown agent 'nobody'"):
            await clients[0].request(
                m.Heartbeat(agent_id="nobody", round=1), m.HeartbeatReply, timeout_s=5
            )
        # Answered on the spot (no task per request), and the connection serves on.
        beat = await clients[0].request(
            m.Heartbeat(agent_id=ids[0], round=a1.round), m.HeartbeatReply, timeout_s=5
        )
        assert (beat.round, beat.member) == (a1.round, True)
        for c in clients:
            await c.close()
        job.cancel()
        await server.close()

    asyncio.run(body())
    events = (tmp_path / "events.jsonl").read_text()
    assert '"event":"rendezvous_complete"' in events


def test_worker_failure_opens_a_round_and_budget_is_per_job(tmp_path: Path) -> None:
    async def body() -> None:
        cfg = MasterConfig(
            host="127.0.0.1",
            port=0,
            nnodes=NodeRange.parse("2:2"),
            job_dir=str(tmp_path),
            max_restarts=1,
            last_call_s=0.1,
        )
        server = MasterServer(
            build_master(cfg, NoCluster(), job_dir=tmp_path, stores=FakeStores()), token=TOKEN
        )
        port = await server.start()
        job = asyncio.create_task(server.master.job.run())
        cs = [await MasterClient.connect("127.0.0.1", port, token=TOKEN) for _ in range(2)]
        ids = [
            (
                await c.request(m.Join(node=f"n{i}", addr="x", nproc=1), m.JoinReply, timeout_s=5)
            ).agent_id
            for i, c in enumerate(cs)
        ]

        async def round_of(after: int) -> list[m.Assignment]:
            return list(
                await asyncio.gather(
                    *[
                        c.request(
                            m.WaitRound(agent_id=a, after_round=after), m.Assignment, timeout_s=10
                        )
                        for c, a in zip(cs, ids, strict=True)
                    ]
                )
            )

        first = await round_of(0)
        fail = m.WorkerFailed(
            agent_id=ids[1],
            round=1,
            local_rank=0,
            rank=1,
            exit_code=-9,
            signal="SIGKILL",
            classification="software",
            reason="killed",
        )
        await cs[1].request(fail, m.Ack, timeout_s=5)
        push = await asyncio.wait_for(cs[0].pushes.get(), 5)  # the other agent is told at once
        assert isinstance(push, m.RoundChanged) and push.round == 2
        second = await round_of(1)
        assert [a.restart_count for a in second] == [1, 1]  # the same count on every node
        assert first[0].store_port != second[0].store_port  # a fresh store per round
        fail2 = m.WorkerFailed(
            agent_id=ids[0],
            round=2,
            local_rank=0,
            rank=0,
            exit_code=1,
            signal=None,
            classification="software",
            reason="again",
        )
        await cs[0].request(fail2, m.Ack, timeout_s=5)
        final = await round_of(2)
        assert [a.status for a in final] == ["finished", "finished"]
        assert final[0].exit_code == 1 and "restarts are used up" in final[0].reason
        for c in cs:
            await c.close()
        job.cancel()
        await server.close()

    asyncio.run(body())


def test_the_master_raises_its_open_files_limit_for_one_connection_per_node() -> None:
    """Many clusters start jobs with a soft limit of 1,024 files: a master that kept it would
    refuse agents past about a thousand.  Run in a child process (the limit is per process)."""
    code = textwrap.dedent(
        """
        import resource
        from dlrover_hpc.master.server import SPARE_FILES, raise_open_files_limit
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        raise_open_files_limit(4096)
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now >= min(hard, 4096 + SPARE_FILES), (now, hard)
        print("ok", now)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr


def test_a_large_job_is_told_a_longer_heartbeat_and_the_collector_is_quieted(
    tmp_path: Path,
) -> None:
    """At most HEARTBEATS_PER_S heartbeats a second reach the master: 2 s up to 1,024 nodes,
    longer past it; silence counts as loss only after three of them."""
    small = MasterConfig(nnodes=NodeRange.parse("2:1024"))
    assert (small.heartbeat_every_s, small.heartbeat_silence_s) == (2.0, 15.0)
    large = MasterConfig(nnodes=NodeRange.parse("2048:4096"))
    assert large.heartbeat_every_s == 4096 / HEARTBEATS_PER_S == 8.0
    assert large.heartbeat_silence_s == 24.0
    huge = MasterConfig(
        nnodes=NodeRange.parse("1:16384"), heartbeat_interval_s=40.0, heartbeat_timeout_s=200.0
    )
    assert (huge.heartbeat_every_s, huge.heartbeat_silence_s) == (40.0, 200.0)  # set: kept

    before = gc.get_threshold()

    async def body() -> None:
        server = _server(tmp_path, "2:4096")
        port = await server.start()
        assert gc.get_threshold() == GC_THRESHOLDS
        client = await MasterClient.connect("127.0.0.1", port, token=TOKEN)
        reply = await client.request(
            m.Join(node="n1", addr="n1", nproc=8), m.JoinReply, timeout_s=5
        )
        assert reply.heartbeat_interval_s == 8.0
        await client.close()
        await server.close()

    try:
        asyncio.run(body())
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
