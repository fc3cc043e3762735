"""Cross-node memory replicas: real sockets on loopback and real segment files in a directory
standing in for /dev/shm.  A copy arrives whole or not at all, never blocks the writer, and
a bad peer, a torn send or a full node leaves the previous copy in place."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver.replica_sender import ReplicaSender
from dlrover_hpc.checkpoint.saver.replicas import (
    ReplicaServer,
    digest,
    read_step,
    recv_exact,
    recv_json,
    replica_peers,
    send_json,
)
from dlrover_hpc.checkpoint.saver.segments import (
    Segment,
    list_segments,
    needed_size,
    unlink_segments,
)

TOKEN = "t" * 32
A = "dlrover-hpc-u-job-nodeA-"  # the sending node's prefix
B = "dlrover-hpc-u-job-nodeB-"  # the receiving node's


def write(path: Path, step: int, image: bytes) -> Segment:
    """A complete segment of `step` holding `image`, as a trainer writes it."""
    seg = Segment(str(path), writable=True)
    meta = json.dumps({"step": step, "rank": 3, "kind": "rank", "world_size": 4}).encode()
    seg.ensure_size(needed_size(len(image), len(meta)))
    seg.lock(exclusive=True)
    seq = seg.begin_write()
    assert seg.mm is not None
    seg.mm[4096 : 4096 + len(image)] = image
    seg.finish_write(seq=seq, step=step, image_len=len(image), meta=meta)
    seg.unlock()
    return seg


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    return a, b


@pytest.fixture
def server(dirs: tuple[Path, Path]) -> Iterator[ReplicaServer]:
    srv = ReplicaServer(
        shm_dir=str(dirs[1]), prefix=B, token=TOKEN, host="127.0.0.1", node_name="B"
    )
    srv.start()
    yield srv
    srv.close()


def sender(a: Path, events: ListEventSink | None = None, token: str = TOKEN) -> ReplicaSender:
    return ReplicaSender(shm_dir=str(a), prefix=A, token=token, node_name="A", events=events)


def copy_of(b: Path, name: str = "r3-a") -> Path:
    return b / f"{B}c{name}"


def test_a_copy_arrives_whole_under_its_copy_name(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    seg = write(a / f"{A}r3-a", 7, os.urandom(300_000))
    events = ListEventSink()
    s = sender(a, events)
    try:
        s.set_peers([server.address])
        s.offer(seg.path, 7)
        assert s.wait_idle(30)
    finally:
        s.close()
        seg.close()
    header = read_step(str(copy_of(b)))
    assert header == 7
    sent = (a / f"{A}r3-a").read_bytes()
    got = copy_of(b).read_bytes()
    assert got == sent[: len(got)] and len(got) < len(sent)  # the step's bytes, not the slack
    assert [n.path for n in list_segments(str(b), B, copies=True)] == [str(copy_of(b))]
    assert list_segments(str(b), B) == []  # a copy is not one of the node's own segments
    (event,) = events.named("checkpoint_replicated")
    assert event["step"] == 7 and event["name"] == "r3-a" and event["bytes"] == len(got)
    assert event["peers"] == [f"127.0.0.1:{server.address[1]}"]
    assert unlink_segments(str(b), B) == [str(copy_of(b))]


def test_offers_coalesce_to_the_newest_step(dirs: tuple[Path, Path], server: ReplicaServer) -> None:
    a, b = dirs
    s = sender(a)
    try:
        s.set_peers([server.address])
        for step in range(1, 30):
            seg = write(a / f"{A}r3-b", step, bytes([step]) * 50_000)
            s.offer(seg.path, step)
            seg.close()
        assert s.wait_idle(30)
        assert s.stats()["copies"] <= 29
    finally:
        s.close()
    assert read_step(str(copy_of(b, "r3-b"))) == 29


def test_a_send_torn_by_a_new_save_keeps_the_previous_copy(dirs: tuple[Path, Path]) -> None:
    """A peer that reads slowly: the trainer starts its next save while the bytes are in
    flight; the sender sees the changed header and the peer drops the copy."""
    a, b = dirs
    (b / f"{B}cr3-a").write_bytes(b"previous copy")
    listener = socket.create_server(("127.0.0.1", 0))
    seg = write(a / f"{A}r3-a", 5, os.urandom(32 << 20))  # more than the socket buffers
    trailer: list[bytes] = []

    def slow_peer() -> None:
        conn, _ = listener.accept()
        with conn:
            nonce = os.urandom(32)
            conn.sendall(nonce)
            assert recv_exact(conn, 32) == digest(TOKEN, nonce)
            header = recv_json(conn)
            assert header is not None
            send_json(conn, {"ok": True})
            seg.lock(exclusive=True)
            seg.begin_write()  # the next save begins; the sender is stuck in sendall
            recv_exact(conn, header["size"])
            trailer.append(recv_exact(conn, 1) or b"")
            send_json(conn, {"ok": False, "error": "torn copy dropped"})

    peer = threading.Thread(target=slow_peer)
    peer.start()
    s = sender(a)
    try:
        s.set_peers([listener.getsockname()])
        s.offer(seg.path, 5)
        assert s.wait_idle(60)
        peer.join(30)
        assert trailer == [b"\x00"] and s.stats()["torn"] == 1 and s.stats()["copies"] == 0
    finally:
        s.close()
        seg.unlock()
        seg.close()
        listener.close()


def _raw_client(server: ReplicaServer, token: str = TOKEN) -> socket.socket:
    conn = socket.create_connection(server.address, timeout=10)
    nonce = recv_exact(conn, 32)
    assert nonce is not None
    conn.sendall(digest(token, nonce))
    return conn


def test_the_server_keeps_the_old_copy_on_abort_disconnect_and_bad_input(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    seg = write(a / f"{A}r3-a", 9, os.urandom(100_000))
    data = (a / f"{A}r3-a").read_bytes()
    seg.close()
    copy_of(b).write_bytes(b"previous copy")
    frame = {"name": "r3-a", "step": 9, "seq": 1, "size": len(data), "node": "A"}
    # The sender says its source changed while sending (trailer 0).
    with _raw_client(server) as conn:
        send_json(conn, frame)
        assert recv_json(conn) == {"ok": True}
        conn.sendall(data + b"\x00")
        assert recv_json(conn) == {"ok": False, "error": "torn copy dropped"}
    # The sender dies half way.
    with _raw_client(server) as conn:
        send_json(conn, frame)
        assert recv_json(conn) == {"ok": True}
        conn.sendall(data[: len(data) // 2])
    # Names that would leave the directory, or are not segments, and nonsense sizes.
    for bad in ({"name": "../x-a"}, {"name": "r1-a/.."}, {"name": "x"}, {"size": -1}):
        with _raw_client(server) as conn:
            send_json(conn, {**frame, **bad})
            reply = recv_json(conn)
            assert reply is not None and reply["ok"] is False and "bad" in reply["error"]
    # A wrong token: the server hangs up before any copy.
    with _raw_client(server, token="u" * 32) as conn:
        send_json(conn, frame)
        try:
            reply = recv_json(conn)
        except ConnectionResetError:  # it closed with our frame unread
            reply = None
        assert reply is None
    server.close()  # joins the connection threads: every copy above has ended
    assert copy_of(b).read_bytes() == b"previous copy"
    assert sorted(os.listdir(b)) == [copy_of(b).name]  # no temporary file, nothing else


def test_a_copy_over_the_memory_limit_is_refused_with_the_fix(
    dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = dirs
    srv = ReplicaServer(
        shm_dir=str(b),
        prefix=B,
        token=TOKEN,
        host="127.0.0.1",
        mem_limit_bytes=1 << 20,
        node_name="B",
    )
    srv.start()
    seg = write(a / f"{A}r3-a", 2, os.urandom(2 << 20))
    s = sender(a)
    try:
        s.set_peers([srv.address])
        s.offer(seg.path, 2)
        assert s.wait_idle(30)
        assert s.stats()["failures"] == 1
    finally:
        s.close()
        seg.close()
        srv.close()
    assert not os.listdir(b)
    assert "lower replica_count or raise --mem" in caplog.text


def test_a_dead_peer_does_not_stop_copies_to_the_live_one(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    dead = socket.create_server(("127.0.0.1", 0))
    dead_address = dead.getsockname()
    dead.close()  # nobody listens there now
    seg = write(a / f"{A}r3-a", 4, os.urandom(10_000))
    events = ListEventSink()
    s = sender(a, events)
    try:
        s.set_peers([dead_address, server.address])
        s.offer(seg.path, 4)
        assert s.wait_idle(30)
    finally:
        s.close()
        seg.close()
    assert read_step(str(copy_of(b))) == 4
    (event,) = events.named("checkpoint_replicated")
    assert event["peers"] == [f"127.0.0.1:{server.address[1]}"]


def test_copies_older_than_every_own_step_are_pruned(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    own = [write(b / f"{B}r0-a", 10, b"x" * 1000), write(b / f"{B}r0-b", 11, b"y" * 1000)]
    stale = write(b / f"{B}cr7-a", 3, b"z" * 1000)  # a copy from an old world
    seg = write(a / f"{A}r3-b", 11, b"w" * 1000)
    s = sender(a)
    try:
        s.set_peers([server.address])
        s.offer(seg.path, 11)
        assert s.wait_idle(30)
    finally:
        s.close()
        for x in [*own, stale, seg]:
            x.close()
    names = {p.name for p in b.iterdir()}
    assert f"{B}cr3-b" in names and f"{B}cr7-a" not in names


@given(st.integers(1, 64), st.integers(0, 8), st.data())
def test_replica_peers_are_distinct_other_nodes(
    nnodes: int, count: int, data: st.DataObject
) -> None:
    me = data.draw(st.integers(0, nnodes - 1))
    peers = replica_peers(me, nnodes, count)
    assert len(peers) == min(count, nnodes - 1)
    assert len(set(peers)) == len(peers) and me not in peers
    assert all(0 <= p < nnodes for p in peers)
    assert peers == replica_peers(me, nnodes, count)  # every node computes the same


def test_replica_peers_spread_over_the_ring() -> None:
    assert replica_peers(0, 8, 1) == [4]  # the far side, likely under another switch
    assert replica_peers(0, 9, 2) == [3, 6]
    assert replica_peers(2, 3, 5) == [0, 1]
