"""Hostile input (issue 28, item 3): hypothesis-made frames against the three endpoints a job
opens, on real sockets, while a real job trains beside them (``dlrover-run --standalone``:
one process hosts the agent, its master, its checkpoint saver and its replica server).

- the master's wire (TCP, job token): garbage, truncated frames, length fields up to 2^32-1,
  bad and replayed HMACs before authentication; unknown types, bad fields and valid frames in
  the wrong order after it;
- the saver's socket (Unix, the job's workers): the same on its framing and requests;
- the replica server (TCP, job token): bad and replayed HMACs, bad copy headers (sizes up to
  2^64), copies cut short;
- slow-loris connections that say nothing while others are served.

Each bad frame gets an error reply or a clean close and one log line, never a traceback;
the job finishes; the process's memory stays bounded. 10,000 frames per endpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from runtime_helpers import BIN, events, named

from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.protocol.wire import MAX_AUTH_FRAME

_LEN = struct.Struct(">I")
AUTH_CONTEXT = b"dlrover-hpc/v1"
REPLICA_CONTEXT = b"dlrover-hpc/replica/v1"

TRAIN = r"""
import os, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType

stop, ckpt_dir = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
ckpt = DdpCheckpointer(ckpt_dir)
step = 0
while step < 20000:
    step += 1
    loss = model(torch.randn(8, 64)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        kind = StorageType.DISK if step % 50 == 0 else StorageType.MEMORY
        ckpt.save_checkpoint(step, {"model": model.state_dict(), "step": step}, storage_type=kind)
        done = torch.tensor([float(os.path.exists(stop))])
        dist.all_reduce(done)
        if done.item():
            break
    time.sleep(0.1)
ckpt.close()
print("trained", step, flush=True)
"""


# ------------------------------------------------------------------ raw sockets
def frame(payload: bytes, length: int | None = None) -> bytes:
    return _LEN.pack(len(payload) if length is None else length) + payload


def jframe(obj: Any) -> bytes:
    return frame(json.dumps(obj).encode())


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    head = recv_exact(sock, 4)
    if head is None:
        return None
    body = recv_exact(sock, _LEN.unpack(head)[0])
    return None if body is None else json.loads(body)


def closed(sock: socket.socket, timeout_s: float = 15.0) -> bool:
    """Whether the peer closes (after any replies it still sends) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


class Master:
    def __init__(self, job_dir: Path) -> None:
        info = json.loads((job_dir / "master.json").read_text())
        self.address = ("127.0.0.1", int(info["port"]))
        self.token = (job_dir / "token").read_text().strip()

    def open(self) -> tuple[socket.socket, str]:
        sock = socket.create_connection(self.address, timeout=15)
        challenge = recv_frame(sock)
        assert challenge is not None and challenge["type"] == "challenge", challenge
        return sock, challenge["body"]["nonce"]

    def digest(self, nonce: str) -> str:
        return hmac.new(
            self.token.encode(), AUTH_CONTEXT + nonce.encode(), hashlib.sha256
        ).hexdigest()

    def authed(self) -> socket.socket:
        sock, nonce = self.open()
        sock.sendall(
            jframe({"v": 1, "type": "auth", "id": None, "body": {"digest": self.digest(nonce)}})
        )
        reply = recv_frame(sock)
        assert reply is not None and reply["type"] == "auth_ok", reply
        return sock

    def status(self) -> dict[str, Any]:
        with contextlib.closing(self.authed()) as sock:
            sock.sendall(jframe({"v": 1, "type": "status", "id": 1, "body": {}}))
            reply = recv_frame(sock)
        assert reply is not None and reply["type"] == "status_reply", reply
        return reply


class Replicas:
    def __init__(self, port: int, token: str) -> None:
        self.address, self.token = ("127.0.0.1", port), token

    def open(self) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection(self.address, timeout=15)
        nonce = recv_exact(sock, 32)
        assert nonce is not None
        return sock, nonce

    def digest(self, nonce: bytes) -> bytes:
        return hmac.new(self.token.encode(), REPLICA_CONTEXT + nonce, hashlib.sha256).digest()

    def authed(self) -> socket.socket:
        sock, nonce = self.open()
        sock.sendall(self.digest(nonce))
        return sock


# ------------------------------------------------------------------ the job beside the fuzzer
class Job:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.job_dir, self.stop = tmp, tmp / "job", tmp / "stop"
        script = tmp / "train.py"
        script.write_text(TRAIN)
        self.log = open(tmp / "agent.log", "w+")  # noqa: SIM115 (closed in finish)
        self.proc = subprocess.Popen(
            [
                str(BIN / "dlrover-run"),
                "--standalone",
                "--nproc-per-node=2",
                f"--job-dir={self.job_dir}",
                "--rdzv-id=hostile",
                str(script),
                str(self.stop),
                str(tmp / "ckpt"),
            ],
            cwd=tmp,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        wait_for(
            lambda: named(events(self.job_dir), "checkpoint_saved"),
            timeout_s=120,
            what="the job's first checkpoint",
        )
        text = self.text()
        self.master = Master(self.job_dir)
        self.saver = re.findall(r"checkpoint saver listening socket=(\S+)", text)[0]
        port = int(re.findall(r"replica_server_listening port=(\d+)", text)[0])
        self.replicas = Replicas(port, self.master.token)
        self.process = psutil.Process(self.proc.pid)

    def text(self) -> str:
        return (self.tmp / "agent.log").read_text()

    def rss(self) -> int:
        return self.process.memory_info().rss

    def finish(self) -> int:
        self.stop.touch()
        try:
            return self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    j = Job(tmp_path_factory.mktemp("hostile"))
    try:
        yield j
    finally:
        if j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()


FUZZ = settings(
    deadline=None,
    database=None,
    derandomize=True,  # the same frames in every run: a failure here is reproducible
    suppress_health_check=list(HealthCheck),
)
#: JSON values that break naive code (cheap to draw: a recursive strategy costs ~5 ms a frame)
TRICKY = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**63,
    2**64,
    -(2**64),
    10**30,
    1e308,
    float("inf"),
    float("nan"),
    -0.0,
    "",
    "x" * 1000,
    "\u0000",
    "../../etc/passwd",
    [],
    {},
    [[[[[]]]]],
    {"a": {"b": [1, None]}},
    [1, "2", None],
]
json_values = st.sampled_from(TRICKY) | st.integers() | st.text(max_size=12)


# the master's requests that name an agent: sent for agents that never joined (wrong order)
AGENT_REQUESTS = [
    "heartbeat",
    "wait_round",
    "workers_started",
    "worker_failed",
    "workers_succeeded",
    "netcheck_report",
    "stacks_dumped",
]


BATCH = 10


def fuzz(frames: int, cases: dict[str, Any]) -> Any:
    """Runs the decorated ``fn(kind, arg)`` once per frame, on ``frames`` frames: hypothesis
    draws the kind and only that kind's argument (``cases``), in batches of :data:`BATCH`
    (one draw per example costs ~1.4 ms of CPU, a frame of a batch ~0.1-0.3 ms: the suite
    runs on two cores)."""
    one_frame = st.one_of([st.tuples(st.just(k), strategy) for k, strategy in cases.items()])

    def wrap(fn: Any) -> Any:
        @settings(FUZZ, max_examples=frames // BATCH)
        @given(st.lists(one_frame, min_size=BATCH, max_size=BATCH))
        def run(batch: list[tuple[str, Any]]) -> None:
            for kind, arg in batch:
                fn(kind, arg)

        return run

    return wrap


class Counter:
    def __init__(self) -> None:
        self.frames = 0


def _refused_or_zero(timeout: float) -> float:
    """A timeout the saver refuses (negative, NaN, over a day), else 0: an accepted wait
    would hold the fuzzer for as long as it asks."""
    return 0.0 if 0 <= timeout <= 24 * 3600 else timeout


# ------------------------------------------------------------------ the master's wire
def _master_before_auth(job: Job, count: Counter) -> None:
    master = job.master
    old_sock, old_nonce = master.open()  # a digest seen on the wire, replayed later
    replayed = master.digest(old_nonce)
    old_sock.close()
    nothing = st.just(b"")

    @fuzz(
        1500,
        {
            "garbage": st.binary(max_size=64),
            "huge": st.integers(MAX_AUTH_FRAME + 1, 2**32 - 1),
            "truncated": st.binary(max_size=64),
            "not_json": st.binary(max_size=64),
            "deep": nothing,
            "bad_hmac": st.text(alphabet="0123456789abcdef", max_size=64),
            "replay": nothing,
            "other_type": st.sampled_from(AGENT_REQUESTS),
        },
    )
    def one(kind: str, arg: Any) -> None:
        sock, _ = master.open()
        with contextlib.closing(sock):
            if kind == "garbage":
                payload = arg
            elif kind == "huge":
                payload = _LEN.pack(arg) + b"{"
            elif kind == "truncated":
                payload = _LEN.pack(len(arg) + 10) + arg
            elif kind == "not_json":
                payload = frame(b"\xff" + arg)
            elif kind == "deep":
                payload = frame(b"[" * 3000)
            elif kind in ("bad_hmac", "replay"):
                digest = arg if kind == "bad_hmac" else replayed
                payload = jframe({"v": 1, "type": "auth", "id": None, "body": {"digest": digest}})
            else:
                payload = jframe({"v": 1, "type": arg, "id": 1, "body": {"agent_id": "x"}})
            sock.sendall(payload)
            if kind in ("garbage", "truncated"):
                sock.shutdown(socket.SHUT_WR)  # the rest never comes
            count.frames += 1
            assert closed(sock), kind

    one()


def _master_after_auth(job: Job, count: Counter) -> None:
    master = job.master
    conn = [master.authed()]
    fields = st.sampled_from(["agent_id", "round", "step", "progress", "x", ""])

    @fuzz(
        8500,
        {
            "unknown_type": st.text(max_size=30),
            "bad_fields": st.tuples(
                st.sampled_from(AGENT_REQUESTS), st.dictionaries(fields, json_values, max_size=4)
            ),
            "wrong_order": st.tuples(st.sampled_from(AGENT_REQUESTS), st.text(max_size=20)),
            "bad_body": json_values,
            "bad_version": json_values,
        },
    )
    def one(kind: str, arg: Any) -> None:
        obj: dict[str, Any] = {"v": 1, "type": "heartbeat", "id": 7, "body": {}}
        if kind == "unknown_type":
            obj["type"] = "no_such_" + arg
        elif kind == "bad_fields":
            obj["type"], obj["body"] = arg
        elif kind == "wrong_order":  # a well-formed request for an agent that never joined
            obj["type"], obj["body"] = arg[0], {"agent_id": "ghost-" + arg[1], "round": 1}
        elif kind == "bad_body":
            obj["body"] = arg if not isinstance(arg, dict) else [arg]
        else:
            obj["v"] = arg if arg != 1 else 2
        conn[0].sendall(jframe(obj))
        count.frames += 1
        reply = recv_frame(conn[0])
        if kind in ("bad_body", "bad_version"):  # a framing error: the connection ends
            assert reply is None or reply["type"] == "error", reply
            assert closed(conn[0])
            conn[0] = master.authed()
            return
        # refused (an unknown agent, a bad field), or a harmless ack (stacks for no request)
        assert reply is not None and reply["id"] == 7, (obj, reply)
        assert reply["type"] == "error" or (kind != "unknown_type" and reply["type"] == "ack")

    one()
    conn[0].close()


# ------------------------------------------------------------------ the saver's socket
def _saver(job: Job, count: Counter) -> None:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(job.saver)
        sock.settimeout(15)
        return sock

    conn = [connect()]
    nothing = st.just(b"")

    @fuzz(
        10000,
        {
            "garbage": st.binary(min_size=1, max_size=64),
            "huge": st.integers((1 << 20) + 1, 2**32 - 1),
            "not_json": st.binary(max_size=64),
            "deep": nothing,
            "not_object": json_values,
            "unknown": st.text(max_size=20),
            "saved": st.tuples(st.text(max_size=40), json_values),
            "wait": st.tuples(
                st.text(max_size=20), st.one_of(st.floats(), st.integers(-(2**64), 2**64))
            ),
            "bad_version": json_values,
        },
    )
    def one(kind: str, arg: Any) -> None:
        fatal = kind in ("garbage", "huge", "not_json", "deep", "not_object")
        if kind == "garbage":
            payload = _LEN.pack(len(arg) + 1000) + arg
        elif kind == "huge":
            payload = _LEN.pack(arg)
        elif kind == "not_json":
            payload = frame(b"\xff" + arg)
        elif kind == "deep":
            payload = frame(b"[" * 3000)
        elif kind == "not_object":
            payload = jframe([arg])
        elif kind == "unknown":
            payload = jframe({"v": 1, "type": f"x{arg}", "id": 3})
        elif kind == "saved":
            payload = jframe({"v": 1, "type": "saved", "id": 3, "segment": arg[0], "step": arg[1]})
        elif kind == "wait":
            request = {
                "v": 1,
                "type": "wait",
                "id": 3,
                "ckpt_dir": str(job.tmp / "nowhere" / arg[0].replace("/", "_")),
                "step": 10**9,
                "rank": 0,
                "token": 1,
                "timeout_s": _refused_or_zero(arg[1]),
            }
            payload = jframe(request)
        else:
            payload = jframe({"v": arg if arg != 1 else 0, "type": "ping", "id": 3})
        count.frames += 1
        conn[0].sendall(payload)
        if fatal:
            if kind == "garbage":
                conn[0].shutdown(socket.SHUT_WR)
            assert closed(conn[0]), kind
            conn[0].close()
            conn[0] = connect()
            return
        reply = recv_frame(conn[0])
        assert reply is not None, kind
        if kind == "wait" and reply["ok"]:  # a wait it accepted (0 s): not committed
            assert reply["committed"] is False, reply
            return
        assert reply["ok"] is False and reply["error"], (kind, reply)

    one()
    conn[0].close()


# ------------------------------------------------------------------ the replica server
def _replicas(job: Job, count: Counter) -> None:
    replicas = job.replicas
    old, old_nonce = replicas.open()
    replayed = replicas.digest(old_nonce)
    old.close()

    @fuzz(
        10000,
        {
            "bad_hmac": st.binary(min_size=32, max_size=32),
            "replay": st.just(b""),
            "short": st.binary(max_size=31),
            "bad_header": st.tuples(st.text(max_size=20), json_values),
            "huge_size": st.integers(2**40 + 1, 2**64),
            "not_json": st.binary(max_size=40),
        },
    )
    def one(kind: str, arg: Any) -> None:
        count.frames += 1
        if kind in ("bad_hmac", "replay", "short"):
            sock, _ = replicas.open()
            with contextlib.closing(sock):
                sock.sendall(replayed if kind == "replay" else arg)
                if kind == "short":
                    sock.shutdown(socket.SHUT_WR)
                assert closed(sock), kind
            return
        with contextlib.closing(replicas.authed()) as sock:
            header: Any = {"name": "r0-a", "size": 1024, "step": 1, "seq": 1, "node": "fuzz"}
            if kind == "bad_header":
                header.update(name="x" + arg[0], size=arg[1], step=arg[1])
            elif kind == "huge_size":
                header["size"] = arg
            sock.sendall(frame(b"\xff" + arg) if kind == "not_json" else jframe(header))
            reply = recv_frame(sock)
            assert reply is not None and reply["ok"] is False, (kind, header, reply)
            assert closed(sock), kind

    one()


def _cut_short_copies(job: Job) -> None:
    """Copies whose sender stops half-way: dropped, no temporary file left."""
    for _ in range(20):
        with contextlib.closing(job.replicas.authed()) as sock:
            header = {"name": "r0-a", "size": 1 << 20, "step": 1, "seq": 1, "node": "fuzz"}
            sock.sendall(jframe(header))
            reply = recv_frame(sock)
            if reply is None or not reply["ok"]:  # the node has not joined yet: refused
                continue
            sock.sendall(os.urandom(1 << 16))


def _slow_loris(job: Job) -> None:
    """Connections that say nothing hold no one up."""
    idle = [socket.create_connection(job.master.address) for _ in range(64)]
    idle += [socket.create_connection(job.replicas.address) for _ in range(64)]
    for _ in range(32):
        s = socket.socket(socket.AF_UNIX)
        s.connect(job.saver)
        idle.append(s)
    try:
        t0 = time.monotonic()
        assert job.master.status()["body"]["job_id"]
        with contextlib.closing(job.replicas.authed()) as sock:
            sock.sendall(jframe({"name": "no good", "size": 1, "step": 1, "seq": 1}))
            assert recv_frame(sock) is not None
        assert time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()


def test_three_endpoints_under_hostile_input_while_a_job_trains(job: Job) -> None:
    rss0 = job.rss()
    counts = {"master": Counter(), "saver": Counter(), "replicas": Counter()}
    phases = [
        (_master_before_auth, "master"),
        (_master_after_auth, "master"),
        (_saver, "saver"),
        (_replicas, "replicas"),
    ]
    for phase, endpoint in phases:
        t0, c0 = time.perf_counter(), time.process_time()
        phase(job, counts[endpoint])
        took = (time.perf_counter() - t0, time.process_time() - c0)
        print(f"{phase.__name__}: {took[0]:.1f} s ({took[1]:.1f} s of our CPU)")
    _cut_short_copies(job)
    _slow_loris(job)
    grown = job.rss() - rss0
    print({k: c.frames for k, c in counts.items()}, f"rss grew {grown / 2**20:.1f} MiB")
    assert all(c.frames >= 10000 for c in counts.values()), {k: c.frames for k, c in counts.items()}
    assert grown < 64 << 20, grown  # nothing kept per bad frame or per connection

    # The job trained on through all of it and finishes as it would have.
    assert job.master.status()["body"]["job_id"]
    rc = job.finish()
    text = job.text()
    assert rc == 0, text[-3000:]
    assert "trained" in text and "Traceback" not in text, text[-3000:]
    assert named(events(job.job_dir), "job_finished")[-1]["exit_code"] == 0
    assert not named(events(job.job_dir), "worker_failed")
    # One line per refused connection or request, never silent: each kind is in the log.
    for line in (
        "connection refused peer=",  # the master, before authentication
        "connection dropped peer=",  # the master, a framing error after it
        "saver_conn_refused",
        "saver_request_refused",
        "replica_refused peer=",
        "replica_refused origin=",
    ):
        assert line in text, line
    leftovers = [n for n in os.listdir("/dev/shm") if "hostile" in n and n.endswith(".tmp")]
    assert not leftovers, leftovers
