"""Cross-node memory replicas: real sockets on loopback and real segment files in a directory
standing in for /dev/shm.  A copy arrives whole or not at all, never blocks the writer, and
a bad peer, a torn send or a full node leaves the previous copy in place."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlrover_hpc.checkpoint.event_sinks import ListEventSink
from dlrover_hpc.checkpoint.saver import replica_sender
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
    Header,
    Segment,
    SegmentName,
    list_segments,
    needed_size,
    read_header,
    unlink_segments,
)
from dlrover_hpc.localslurm.wait import wait_for

pytestmark = pytest.mark.timeout(60)

TOKEN = "t" * 32
A = "dlrover-hpc-u-job-nodeA-"  # the sending node's prefix
B = "dlrover-hpc-u-job-nodeB-"  # the receiving node's


def save(seg: Segment, step: int, image: bytes) -> Segment:
    """Writes a complete segment of `step` holding `image`, as a trainer does."""
    meta = json.dumps({"step": step, "rank": 3, "kind": "rank", "world_size": 4}).encode()
    seg.ensure_size(needed_size(len(image), len(meta)))
    seg.lock(exclusive=True)
    seq = seg.begin_write()
    assert seg.mm is not None
    seg.mm[4096 : 4096 + len(image)] = image
    seg.finish_write(seq=seq, step=step, image_len=len(image), meta=meta)
    seg.unlock()
    return seg


def write(path: Path, step: int, image: bytes) -> Segment:
    return save(Segment(str(path), writable=True), step, image)


def step_bytes(path: Path) -> tuple[bytes, Header]:
    """The bytes of `path` that a copy carries (header, image, meta) and their header."""
    data = path.read_bytes()
    header = read_header(data)
    assert header is not None
    return data[: header.size], header


def frame(header: Header, name: str = "r3-a", node: str = "A") -> dict[str, Any]:
    return {"name": name, "step": header.step, "seq": header.seq, "size": header.size, "node": node}


def open_fds() -> set[str]:
    """What this process has open (sockets by inode, files by path)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
    return found


@pytest.fixture(autouse=True)
def no_replica_leaks() -> Iterator[None]:
    """Every sender and server thread ends; no socket or file stays open."""
    before = open_fds()
    yield
    wait_for(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("ckpt-replica")],
        timeout_s=10,
        what="the replica threads to end",
    )
    wait_for(lambda: open_fds() <= before, timeout_s=10, what="no new open files")


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    return a, b


def start_server(b: Path, mem_limit_bytes: int | None = None) -> ReplicaServer:
    srv = ReplicaServer(
        shm_dir=str(b),
        prefix=B,
        token=TOKEN,
        host="127.0.0.1",
        mem_limit_bytes=mem_limit_bytes,
        node_name="B",
    )
    srv.start()
    return srv


@pytest.fixture
def server(dirs: tuple[Path, Path]) -> Iterator[ReplicaServer]:
    srv = start_server(dirs[1])
    yield srv
    srv.close()


def sender(a: Path, events: ListEventSink | None = None) -> ReplicaSender:
    return ReplicaSender(shm_dir=str(a), prefix=A, token=TOKEN, node_name="A", events=events)


@contextlib.contextmanager
def sending(
    a: Path, *segs: Segment, events: ListEventSink | None = None
) -> Iterator[ReplicaSender]:
    """Node A's sender; closes it, then `segs`."""
    s = sender(a, events)
    try:
        yield s
    finally:
        s.close()
        for seg in segs:
            seg.close()


def copy_of(b: Path, name: str = "r3-a") -> Path:
    return b / f"{B}c{name}"


def temporaries(b: Path) -> list[str]:
    return [p.name for p in b.iterdir() if p.name.endswith(".tmp")]


def raw_client(server: ReplicaServer, token: str = TOKEN) -> socket.socket:
    conn = socket.create_connection(server.address, timeout=10)
    nonce = recv_exact(conn, 32)
    assert nonce is not None
    conn.sendall(digest(token, nonce))
    return conn


def offer_one(s: ReplicaSender, peers: list[Any], seg: Segment, step: int) -> None:
    s.set_peers(peers)
    s.offer(seg.path, step)
    assert s.wait_idle(30)


# -- naming -------------------------------------------------------------------------------------
def test_copies_are_listed_apart_from_own_segments_and_removed_with_them(tmp_path: Path) -> None:
    for name in [
        f"{B}r0-a",
        f"{B}r1-x.y-b",
        f"{B}cr3-a",
        f"{B}cr3-tag-b",
        f"{B}cr3-a.1234abcd.tmp",  # a copy being received
        f"{B}r0-a\n",  # not a segment name
        f"{A}r0-a",  # another node's (or job's) segment
        f"{A}cr0-a",
    ]:
        (tmp_path / name).write_bytes(b"")
    d = str(tmp_path)
    assert list_segments(d, B) == [
        SegmentName(path=f"{d}/{B}r0-a", rank=0, buffer=0, tag=""),
        SegmentName(path=f"{d}/{B}r1-x.y-b", rank=1, buffer=1, tag="x.y"),
    ]
    assert list_segments(d, B, copies=True) == [
        SegmentName(path=f"{d}/{B}cr3-a", rank=3, buffer=0, tag="", copy=True),
        SegmentName(path=f"{d}/{B}cr3-tag-b", rank=3, buffer=1, tag="tag", copy=True),
    ]
    removed = unlink_segments(d, B)
    assert sorted(os.path.basename(p) for p in removed) == [
        f"{B}cr3-a",
        f"{B}cr3-a.1234abcd.tmp",
        f"{B}cr3-tag-b",
        f"{B}r0-a",
        f"{B}r1-x.y-b",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{A}cr0-a", f"{A}r0-a", f"{B}r0-a\n"]


# -- the whole path: sender to server -----------------------------------------------------------
def test_a_copy_arrives_whole_under_its_copy_name(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    seg = write(a / f"{A}r3-a", 7, os.urandom(300_000))
    events = ListEventSink()
    with sending(a, seg, events=events) as s:
        offer_one(s, [server.address], seg, 7)
        assert s.stats()["copies"] == 1 and s.stats()["torn"] == s.stats()["failures"] == 0
    sent, header = step_bytes(a / f"{A}r3-a")
    assert copy_of(b).read_bytes() == sent  # the step's bytes, not the segment's slack
    assert len(sent) < os.path.getsize(a / f"{A}r3-a")
    assert [n.path for n in list_segments(str(b), B, copies=True)] == [str(copy_of(b))]
    assert list_segments(str(b), B) == []  # a copy is not one of the node's own segments
    (event,) = events.named("checkpoint_replicated")
    assert {k: v for k, v in event.items() if k not in ("time", "seconds")} == {
        "event": "checkpoint_replicated",
        "node": "A",
        "step": 7,
        "name": "r3-a",
        "peers": [f"127.0.0.1:{server.address[1]}"],
        "bytes": header.size,
    }
    assert event["seconds"] > 0
    assert unlink_segments(str(b), B) == [str(copy_of(b))]


def test_offers_coalesce_to_the_newest_step(
    dirs: tuple[Path, Path], server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server holds the first copy until steps 2..29 are saved and offered: they are one
    pending offer (the newest), and the first copy, torn by those saves, is dropped."""
    a, b = dirs
    entered, gate = threading.Event(), threading.Event()
    check = ReplicaServer._check

    def held(self: ReplicaServer, header: dict[str, Any]) -> str | None:
        if not entered.is_set():
            entered.set()
            gate.wait(20)
        return check(self, header)

    monkeypatch.setattr(ReplicaServer, "_check", held)
    seg = write(a / f"{A}r3-b", 1, bytes([1]) * 50_000)
    with contextlib.ExitStack() as stack, sending(a, seg) as s:
        stack.callback(gate.set)  # never leave the server waiting
        s.set_peers([server.address])
        s.offer(seg.path, 1)
        assert entered.wait(20)
        for step in range(2, 30):
            s.offer(save(seg, step, bytes([step]) * 50_000).path, step)
        gate.set()
        assert s.wait_idle(30)
        assert {k: s.stats()[k] for k in ("copies", "torn", "failures")} == {
            "copies": 1,
            "torn": 1,
            "failures": 0,
        }
    assert copy_of(b, "r3-b").read_bytes() == step_bytes(a / f"{A}r3-b")[0]
    assert read_step(str(copy_of(b, "r3-b"))) == 29


def test_a_send_torn_by_a_new_save_keeps_the_previous_copy(
    dirs: tuple[Path, Path], server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's next save lands between the sender's last byte and its second look at
    the header: the peer drops the torn copy and keeps the one before."""
    a, b = dirs
    seg = write(a / f"{A}r3-a", 5, os.urandom(200_000))
    with sending(a, seg) as s:
        offer_one(s, [server.address], seg, 5)
        previous = copy_of(b).read_bytes()
        save(seg, 6, os.urandom(200_000))
        looks = 0
        real = replica_sender.read_header

        def racing(buf: Any) -> Header | None:
            nonlocal looks
            looks += 1
            # 1: the step to send, 2: the check before the peer, 3: the look after the bytes
            if looks == 3:  # the bytes of step 6 are out; step 7 is saved before the re-read
                save(seg, 7, os.urandom(200_000))
            return real(buf)

        monkeypatch.setattr(replica_sender, "read_header", racing)
        offer_one(s, [server.address], seg, 6)
        assert s.stats()["torn"] == 1 and s.stats()["copies"] == 1
        assert copy_of(b).read_bytes() == previous and temporaries(b) == []
        monkeypatch.undo()
        offer_one(s, [server.address], seg, 7)  # the writer offers its new step
    assert copy_of(b).read_bytes() == step_bytes(a / f"{A}r3-a")[0]
    assert read_step(str(copy_of(b))) == 7


def test_a_save_during_a_slow_send_makes_the_sender_abort(dirs: tuple[Path, Path]) -> None:
    """A peer that reads slowly: the trainer starts its next save while the bytes are in
    flight (32 MiB, more than the socket buffers); the sender says so in its trailer."""
    a, _ = dirs
    listener = socket.create_server(("127.0.0.1", 0))
    seg = write(a / f"{A}r3-a", 5, os.urandom(32 << 20))
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
            send_json(conn, {"ok": False, "error": "dropped"})

    peer = threading.Thread(target=slow_peer)
    peer.start()
    with listener, sending(a, seg) as s:
        offer_one(s, [listener.getsockname()], seg, 5)
        peer.join(30)
        assert trailer == [b"\x00"] and s.stats()["torn"] == 1 and s.stats()["copies"] == 0


def test_a_dead_peer_does_not_stop_copies_to_the_live_one(
    dirs: tuple[Path, Path], server: ReplicaServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = dirs
    dead = socket.create_server(("127.0.0.1", 0))
    dead_address = dead.getsockname()
    dead.close()  # nobody listens there now
    seg = write(a / f"{A}r3-a", 4, os.urandom(10_000))
    events = ListEventSink()
    with sending(a, seg, events=events) as s:
        offer_one(s, [dead_address, server.address], seg, 4)
        offer_one(s, [dead_address, server.address], save(seg, 5, os.urandom(10_000)), 5)
        assert s.stats()["failures"] == 2 and s.stats()["copies"] == 2
    assert read_step(str(copy_of(b))) == 5
    assert [(e["step"], e["peers"], e["bytes"]) for e in events.named("checkpoint_replicated")] == [
        (step, [f"127.0.0.1:{server.address[1]}"], step_bytes(a / f"{A}r3-a")[1].size)
        for step in (4, 5)
    ]
    warned = [r for r in caplog.records if "replica_peer_failed" in r.getMessage()]
    assert len(warned) == 1 and f"peer=127.0.0.1:{dead_address[1]}" in warned[0].getMessage()


def test_a_peer_taken_out_of_the_set_is_disconnected(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, _ = dirs

    def serving() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "ckpt-replica-conn"]

    with sending(a, seg := write(a / f"{A}r3-a", 1, b"x" * 1000)) as s:
        offer_one(s, [server.address], seg, 1)
        assert len(serving()) == 1
        s.set_peers([])
        wait_for(lambda: not serving(), timeout_s=10, what="the server to see the hang-up")


# -- the server against a raw client --------------------------------------------------------------
def test_the_server_keeps_the_old_copy_on_abort_disconnect_and_bad_input(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    write(a / f"{A}r3-a", 9, os.urandom(100_000)).close()
    data, header = step_bytes(a / f"{A}r3-a")
    copy_of(b).write_bytes(b"previous copy")
    # The sender says its source changed while sending (trailer 0).
    with raw_client(server) as conn:
        send_json(conn, frame(header))
        assert recv_json(conn) == {"ok": True}
        conn.sendall(data + b"\x00")
        assert recv_json(conn) == {
            "ok": False,
            "error": "the segment changed while it was sent (a new save began); copy dropped",
        }
    # Trailer 1, but the bytes are not the announced step (or not a segment at all).
    for step, payload in ((10, data), (9, b"z" * 99)):
        with raw_client(server) as conn:
            send_json(conn, frame(header) | {"step": step, "size": len(payload)})
            assert recv_json(conn) == {"ok": True}
            conn.sendall(payload + b"\x01")
            error = f"the bytes received are not a complete segment of step {step}"
            assert recv_json(conn) == {"ok": False, "error": error}
    # The sender dies half way.
    with raw_client(server) as conn:
        send_json(conn, frame(header))
        assert recv_json(conn) == {"ok": True}
        conn.sendall(data[: len(data) // 2])
    server.close()  # joins the connection threads: every copy above has ended
    assert copy_of(b).read_bytes() == b"previous copy"
    assert sorted(os.listdir(b)) == [copy_of(b).name]  # no temporary file, nothing else


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"name": "../x-a"}, "bad segment name '../x-a': expected r<rank>[-<tag>]-<a|b>"),
        ({"name": "r1-a/.."}, "bad segment name 'r1-a/..': expected r<rank>[-<tag>]-<a|b>"),
        ({"name": "r1-a\n"}, "bad segment name 'r1-a\\n': expected r<rank>[-<tag>]-<a|b>"),
        ({"name": "cr1-a"}, "bad segment name 'cr1-a': expected r<rank>[-<tag>]-<a|b>"),
        ({"name": 7}, "bad segment name 7: expected r<rank>[-<tag>]-<a|b>"),
        ({"size": -1}, "bad size -1: expected 1 to 1099511627776 bytes"),
        ({"size": 0}, "bad size 0: expected 1 to 1099511627776 bytes"),
        ({"size": True}, "bad size True: expected 1 to 1099511627776 bytes"),
        ({"size": 1 << 41}, "bad size 2199023255552: expected 1 to 1099511627776 bytes"),
        ({"seq": None}, "bad step or seq (9, None)"),
    ],
)
def test_a_bad_copy_header_is_refused_and_writes_nothing(
    tmp_path: Path, bad: dict[str, Any], error: str
) -> None:
    b = tmp_path / "shm"
    b.mkdir()
    srv = start_server(b)
    try:
        with raw_client(srv) as conn:
            send_json(conn, {"name": "r3-a", "step": 9, "seq": 1, "size": 100, "node": "A"} | bad)
            assert recv_json(conn) == {"ok": False, "error": error}
            assert recv_exact(conn, 1) is None  # and it hangs up
    finally:
        srv.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["shm"]


def test_a_bad_frame_gets_an_error_reply(server: ReplicaServer) -> None:
    with raw_client(server) as conn:
        conn.sendall(b"\x00\x00\x00\x08not json")
        reply = recv_json(conn)
        assert reply is not None and reply["ok"] is False
        assert reply["error"].startswith("bad frame: Expecting value")
    with raw_client(server) as conn:
        conn.sendall((1 << 20).to_bytes(4, "big"))
        assert recv_json(conn) == {"ok": False, "error": "bad frame: bad frame of 1048576 bytes"}


def test_a_wrong_token_is_hung_up_on(
    dirs: tuple[Path, Path], server: ReplicaServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = dirs
    write(a / f"{A}r3-a", 9, b"x" * 1000).close()
    data, header = step_bytes(a / f"{A}r3-a")
    with raw_client(server, token="u" * 32) as conn:
        port = conn.getsockname()[1]
        send_json(conn, frame(header))
        try:
            conn.sendall(data + b"\x01")
            reply = recv_json(conn)
        except (ConnectionResetError, BrokenPipeError):  # it closed with our bytes unread
            reply = None
        assert reply is None
    server.close()
    assert os.listdir(b) == []
    assert f"replica_refused peer=('127.0.0.1', {port}) reason=bad job token" in caplog.text


def test_two_copies_of_one_name_in_flight_do_not_mix(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    """An old connection still receiving step 5 while a new one sends step 6 (a reconnect):
    each has its own temporary file; the last to finish is the copy, whole."""
    a, b = dirs
    write(a / f"{A}r3-a", 5, os.urandom(400_000)).close()
    write(a / f"{A}r3-b", 6, os.urandom(400_000)).close()
    (five, h5), (six, h6) = step_bytes(a / f"{A}r3-a"), step_bytes(a / f"{A}r3-b")
    with raw_client(server) as old, raw_client(server) as new:
        send_json(old, frame(h5))
        assert recv_json(old) == {"ok": True}
        old.sendall(five[: len(five) // 2])
        send_json(new, frame(h6))
        assert recv_json(new) == {"ok": True}
        new.sendall(six + b"\x01")
        assert recv_json(new) == {"ok": True}
        assert copy_of(b).read_bytes() == six
        old.sendall(five[len(five) // 2 :] + b"\x01")
        assert recv_json(old) == {"ok": True}
    assert copy_of(b).read_bytes() == five and temporaries(b) == []


def test_close_drops_a_copy_in_flight(dirs: tuple[Path, Path], server: ReplicaServer) -> None:
    a, b = dirs
    write(a / f"{A}r3-a", 9, os.urandom(100_000)).close()
    data, header = step_bytes(a / f"{A}r3-a")
    copy_of(b).write_bytes(b"previous copy")
    with raw_client(server) as conn:
        send_json(conn, frame(header))
        assert recv_json(conn) == {"ok": True}
        conn.sendall(data[:1000])
        wait_for(lambda: temporaries(b), timeout_s=10, what="the copy's temporary file")
        server.close()
        assert recv_exact(conn, 1) is None
    assert sorted(os.listdir(b)) == [copy_of(b).name]
    assert copy_of(b).read_bytes() == b"previous copy"


def test_a_copy_over_the_memory_limit_is_refused_with_the_fix(
    dirs: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = dirs
    write(a / f"{A}r3-a", 2, os.urandom(3 << 20)).close()
    _, header = step_bytes(a / f"{A}r3-a")
    (b / f"{B}r0-a").write_bytes(b"o" * (1 << 20))  # the node's own segment
    (b / "someone-else").write_bytes(b"e" * (1 << 20))  # not this job's: not counted
    used = (b / f"{B}r0-a").stat().st_blocks * 512
    srv = start_server(b, mem_limit_bytes=4 << 20)
    try:
        for node in ("A", "A", "C"):
            with raw_client(srv) as conn:
                send_json(conn, frame(header, node=node))
                assert recv_json(conn) == {
                    "ok": False,
                    "error": f"no room for a {header.size / 2**20:.1f} MiB copy from {node}: "
                    f"this job holds {used / 2**20:.1f} MiB of shared memory on B and the "
                    "limit is 4.0 MiB (--mem); lower replica_count or raise --mem",
                }
        # The sender's side: a failure, and no new warning for the same node.
        with sending(a, seg := Segment(str(a / f"{A}r3-a"), writable=False)) as s:
            offer_one(s, [srv.address], seg, 2)
            assert s.stats()["failures"] == 1 and s.stats()["copies"] == 0
    finally:
        srv.close()
    assert sorted(os.listdir(b)) == [f"{B}r0-a", "someone-else"]
    refused = [r for r in caplog.records if "replica_refused" in r.getMessage()]
    assert [r.levelno for r in refused] == [logging.WARNING, logging.WARNING]  # once per node
    assert "from A:" in refused[0].getMessage() and "from C:" in refused[1].getMessage()


def test_no_space_for_a_copy_is_refused_with_the_fix(
    dirs: tuple[Path, Path], server: ReplicaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = dirs
    write(a / f"{A}r3-a", 2, b"x" * 1000).close()
    _, header = step_bytes(a / f"{A}r3-a")

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with raw_client(server) as conn:
        send_json(conn, frame(header))
        reply = recv_json(conn)
    assert reply is not None and reply["ok"] is False
    assert reply["error"].startswith(
        f"cannot reserve {header.size / 2**20:.1f} MiB in {b} on B for a copy from A "
        "(No space left on device; "
    )
    assert reply["error"].endswith(" MiB free); lower replica_count or enlarge the tmpfs")
    server.close()
    assert os.listdir(b) == []


def test_copies_older_than_every_own_step_are_pruned(
    dirs: tuple[Path, Path], server: ReplicaServer
) -> None:
    a, b = dirs
    for name, step in (("r0-a", 10), ("r0-b", 11), ("cr7-a", 3), ("cr5-a", 10)):
        write(b / f"{B}{name}", step, b"x" * 1000).close()  # own segments; copies: old, current
    old = write(a / f"{A}r3-a", 2, b"u" * 1000)
    new = write(a / f"{A}r3-b", 11, b"w" * 1000)
    with sending(a, old, new) as s:
        offer_one(s, [server.address], old, 2)
        # The copy just written stays even when older than the node's steps; the rest goes.
        assert sorted(p.name for p in b.iterdir() if p.name.startswith(B + "c")) == [
            f"{B}cr3-a",
            f"{B}cr5-a",
        ]
        offer_one(s, [server.address], new, 11)
    assert sorted(p.name for p in b.iterdir()) == [
        f"{B}cr3-b",
        f"{B}cr5-a",
        f"{B}r0-a",
        f"{B}r0-b",
    ]


# -- peer choice --------------------------------------------------------------------------------
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


@pytest.mark.parametrize(
    ("node_rank", "nnodes", "count", "peers"),
    [
        (0, 8, 1, [4]),  # the far side of the ring, likely under another switch
        (0, 9, 2, [3, 6]),
        (7, 8, 1, [3]),
        (5, 16, 3, [9, 13, 1]),
        (0, 4, 3, [1, 2, 3]),  # everyone else
        (2, 3, 5, [0, 1]),  # never more than the other nodes
        (0, 1, 2, []),
        (3, 8, 0, []),
    ],
)
def test_replica_peers_spread_over_the_ring(
    node_rank: int, nnodes: int, count: int, peers: list[int]
) -> None:
    assert replica_peers(node_rank, nnodes, count) == peers


def test_a_round_tells_each_node_only_the_replica_servers_its_copies_can_go_to() -> None:
    """Every node's assignment used to carry every node's replica server: nodes^2 addresses
    per round (16,384 agents took 282 s to rendezvous).  Now a few per node, and every peer a
    count up to MAX_REPLICAS picks is among them."""
    from dlrover_hpc.checkpoint.saver.replicas import MAX_REPLICAS, replica_candidates
    from dlrover_hpc.master.nodes import NodeRecord, round_assignments

    n = 16384
    ranked = [
        NodeRecord(
            agent_id=f"a{i}",
            node=f"n{i}",
            addr=f"n{i}",
            nproc=8,
            slurm_node_id=i,
            topology_addr=None,
            replica_port=7000,
        )
        for i in range(n)
    ]
    out = round_assignments(
        ranked, round=1, store_host="n0", store_port=1, restart_count=0, max_restarts=3,
        run_id="j",
    )  # fmt: skip
    limit = MAX_REPLICAS * (MAX_REPLICAS + 1) // 2
    assert max(len(a.replica_peer_map) for a in out) <= limit
    for me in (0, 1, 4095, n - 1):
        peers = {int(k): v for k, v in out[me].replica_peer_map.items()}
        assert sorted(peers) == replica_candidates(me, n)
        for count in range(1, MAX_REPLICAS + 1):
            assert all(peers[r] == f"n{r}:7000" for r in replica_peers(me, n, count))
