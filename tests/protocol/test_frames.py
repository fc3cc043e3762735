"""Frames cut from a byte stream as it arrives (the master's connections parse them in
``data_received``) and the bytes the encoder writes; one test on real loopback TCP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import struct
from pathlib import Path

import orjson
import pytest

from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import NoCluster
from dlrover_hpc.master.server import MasterServer
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire

FRAMES = [
    wire.Frame(type="challenge", body={"nonce": "ab" * 16}),
    wire.Frame(type="auth_ok"),
    wire.Frame(type="join", id=1, body={"node": "n1", "addr": "n1", "nproc": 8}),
    wire.Frame(type="heartbeat", id=2**40, body={"agent_id": "n1-1", "round": 3, "progress": []}),
]
STREAM = b"".join(wire.encode(f) for f in FRAMES)


def _cut(chunks: list[bytes]) -> list[wire.Frame]:
    buf, out = wire.FrameBuffer(), []
    for chunk in chunks:
        buf.feed(chunk)
        while (payload := buf.pop()) is not None:
            out.append(wire.decode(payload))
    assert len(buf) == 0
    return out


@pytest.mark.parametrize(
    "chunks",
    [
        pytest.param([STREAM], id="all-in-one-read"),
        pytest.param([bytes([b]) for b in STREAM], id="a-byte-a-read"),
        pytest.param([STREAM[:3], STREAM[3:70], STREAM[70:]], id="inside-a-header"),
        pytest.param([STREAM[i : i + 7] for i in range(0, len(STREAM), 7)], id="seven-bytes"),
    ],
)
def test_frames_are_the_same_however_the_bytes_arrive(chunks: list[bytes]) -> None:
    assert _cut(chunks) == FRAMES


@pytest.mark.parametrize(
    ("data", "limit", "left"),
    [
        (b"", wire.MAX_FRAME, 0),  # nothing yet
        (b"\x00\x00", wire.MAX_FRAME, 2),  # half a header
        (struct.pack(">I", 10) + b"12345", wire.MAX_FRAME, 9),  # half a payload
    ],
)
def test_a_frame_not_all_in_is_held(data: bytes, limit: int, left: int) -> None:
    buf = wire.FrameBuffer()
    buf.feed(data)
    assert buf.pop(limit=limit) is None
    assert len(buf) == left


@pytest.mark.parametrize(
    ("announced", "limit"),
    [(wire.MAX_AUTH_FRAME + 1, wire.MAX_AUTH_FRAME), (2**32 - 1, wire.MAX_FRAME)],
)
def test_a_frame_announced_past_the_limit_is_refused_before_its_bytes(
    announced: int, limit: int
) -> None:
    buf = wire.FrameBuffer()
    buf.feed(struct.pack(">I", announced))
    with pytest.raises(ProtocolError, match=f"peer announced a {announced} byte frame"):
        buf.pop(limit=limit)


@pytest.mark.parametrize(
    "frame",
    [
        *FRAMES,
        wire.Frame(type="t", id=None, body={"a": None, "b": [1, None]}),  # null in the body
        wire.Frame(type="t", id=7, body={"n": 2**100}),  # past 64 bits: json's
        wire.Frame(type='q"u\u00e9', id=0, body={"k\n": "\u2603"}),
    ],
)
def test_the_encoder_writes_what_json_writes(frame: wire.Frame) -> None:
    """The same JSON object as before, whichever encoder wrote the body; with no null in
    the frame, the same bytes as orjson's whole frame (what a request was before)."""
    obj = {"v": wire.VERSION, "type": frame.type, "id": frame.id, "body": frame.body}
    data = wire.encode(frame)
    assert json.loads(data[4:]) == obj
    assert wire.decode(data[4:]) == frame
    if frame.id is not None and b"null" not in json.dumps(obj).encode() and frame.id < 2**63:
        with contextlib.suppress(TypeError):  # past 64 bits: orjson refuses it, json writes it
            assert data[4:] == orjson.dumps(obj)


def test_non_finite_floats_go_as_json_writes_them() -> None:
    data = wire.encode(wire.Frame(type="t", id=None, body={"x": math.inf, "y": math.nan}))
    assert b'"x":Infinity' in data and b'"y":NaN' in data and b'"id":null' in data
    body = wire.decode(data[4:]).body
    assert body["x"] == math.inf and math.isnan(body["y"])


class _Stores:
    def ready(self) -> bool:
        return True

    def new_store(self, round: int) -> int:
        return 40000 + round


def test_the_master_answers_frames_split_and_coalesced_on_real_tcp(tmp_path: Path) -> None:
    """The handshake a byte a write, then two requests in one write: each answered, in
    order, with its id; a bad frame ends the connection."""
    cfg = MasterConfig(
        host="127.0.0.1", port=0, nnodes=NodeRange.parse("2:2"), job_dir=str(tmp_path)
    )
    server = MasterServer(
        build_master(cfg, NoCluster(), job_dir=tmp_path, stores=_Stores()), token="tok"
    )

    async def body() -> None:
        port = await server.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        challenge = await wire.read_frame(reader)
        auth = wire.encode(
            wire.Frame(
                type="auth", body={"digest": wire.auth_digest("tok", challenge.body["nonce"])}
            )
        )
        for b in auth:
            writer.write(bytes([b]))
            await writer.drain()
        assert (await wire.read_frame(reader)).type == "auth_ok"
        join = m.Join(node="n1", addr="n1", nproc=2)
        writer.write(
            wire.encode(m.to_frame(join, frame_id=11))
            + wire.encode(m.to_frame(m.ClockRequest(), frame_id=12))
        )
        first, second = await wire.read_frame(reader), await wire.read_frame(reader)
        assert (first.type, first.id, second.type, second.id) == (
            "join_reply",
            11,
            "clock_reply",
            12,
        )
        assert set(server.master.job.nodes) == {first.body["agent_id"]}
        writer.write(struct.pack(">I", 5) + b"nope!")  # not JSON: the connection ends
        with pytest.raises(EOFError):
            await wire.read_frame(reader)
        writer.close()
        for _ in range(100):  # its agent is let go
            if not server._writers:
                break
            await asyncio.sleep(0.01)
        assert not server._writers
        rec = server.master.job.nodes[first.body["agent_id"]]
        assert rec.disconnected_at is not None and not rec.link_timed_out
        await server.close()

    asyncio.run(body())
