"""Worker <-> saver messages over the node's Unix socket.

Frames are a 4-byte big-endian length and a UTF-8 JSON object, never pickle.  A request is
`{"v": 1, "id": N, "type": T, "timeout_s": S, ...}`; the reply echoes the id with `"ok"` and,
on failure, `"error"`.  Types:

- `hello` {rank, local_rank, pid} -> {job_id, node_name, prefix, shm_dir}
- `saved` {segment (file name), step} -> {}: pin the segment and persist the step it holds
- `replicate` {segment, step, count} -> {}: copy the segment to `count` peer nodes' memory
- `wait` {ckpt_dir, step, rank, token} -> {committed}: until the step is committed or timeout_s
- `report` {rank, step, storage, blocking_s, total_s, local_world} -> {}: a save's
  `checkpoint_saved`, which the saver writes once per node and step (`save_events`)
- `ping` {} -> {}
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
from typing import Any

from dlrover_hpc.errors import CheckpointError

VERSION = 1
MAX_FRAME = 1 << 20
#: the longest wait a request may ask for (a commit of a large checkpoint on a slow disk)
MAX_TIMEOUT_S = 24 * 3600.0
_LEN = struct.Struct(">I")


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise CheckpointError(f"message of {len(data)} bytes exceeds the {MAX_FRAME}-byte limit")
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None at a clean end of stream."""
    head = _recv_exact(sock, _LEN.size)
    if head is None:
        return None
    (length,) = _LEN.unpack(head)
    if length > MAX_FRAME:
        raise CheckpointError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    body = _recv_exact(sock, length)
    if body is None:
        raise CheckpointError("connection closed in the middle of a frame")
    try:
        message = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        raise CheckpointError(f"malformed JSON frame: {type(exc).__name__}: {exc}") from None
    if not isinstance(message, dict):
        raise CheckpointError("a frame must hold a JSON object")
    return message


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if not buf:
                return None
            raise CheckpointError("connection closed in the middle of a frame")
        buf += chunk
    return bytes(buf)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    rank: int
    local_rank: int
    pid: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Saved:
    segment: str
    step: int
    spilled: bool = False  # the segment is in the spill directory, not in shared memory


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Both of a rank's buffers are pinned: unpin the queued one (its step is superseded)."""

    segment: str


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Replicate:
    segment: str
    step: int
    count: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Wait:
    ckpt_dir: str
    step: int
    rank: int
    token: int


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Report:
    rank: int
    step: int
    storage: str
    blocking_s: float
    total_s: float
    local_world: int = 0  # the node's ranks: the saver waits for each one's report (0: unknown)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    pass


MESSAGES: dict[str, type] = {
    "hello": Hello,
    "saved": Saved,
    "replicate": Replicate,
    "release": Release,
    "wait": Wait,
    "report": Report,
    "ping": Ping,
}


def decode_request(frame: dict[str, Any]) -> tuple[int, Any, float]:
    """(id, message, timeout_s) of a request frame; raises CheckpointError when malformed."""
    if frame.get("v") != VERSION:
        raise CheckpointError(f"protocol version {frame.get('v')!r} is not {VERSION}")
    kind = frame.get("type")
    cls = MESSAGES.get(str(kind))
    if cls is None:
        raise CheckpointError(f"unknown request type {kind!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        message = cls(**{k: v for k, v in frame.items() if k in names})
    except TypeError as exc:
        raise CheckpointError(f"bad {kind} request: {exc}") from exc
    timeout_s = float(frame.get("timeout_s", 30.0))
    if not 0.0 <= timeout_s <= MAX_TIMEOUT_S:  # NaN too
        raise CheckpointError(f"timeout_s={timeout_s!r}: expected 0 to {MAX_TIMEOUT_S:g} s")
    return int(frame.get("id", 0)), message, timeout_s


def type_of(message: Any) -> str:
    for name, cls in MESSAGES.items():
        if isinstance(message, cls):
            return name
    raise CheckpointError(f"{type(message).__name__} is not a protocol message")


class SaverClient:
    """A worker's connection to its node's saver; one request at a time."""

    def __init__(self, path: str, *, connect_timeout_s: float = 10.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._next = 0
        self._sock = self._connect(connect_timeout_s)

    def _connect(self, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                return sock
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise CheckpointError(
                        f"cannot reach the checkpoint saver at {self.path}: {exc}"
                    ) from exc
                time.sleep(0.1)

    def request(self, message: Any, *, timeout_s: float = 30.0) -> dict[str, Any]:
        with self._lock:
            self._next += 1
            frame = {"v": VERSION, "id": self._next, "type": type_of(message)}
            frame.update(dataclasses.asdict(message))
            frame["timeout_s"] = timeout_s
            try:
                self._sock.settimeout(timeout_s + 10.0)
                send_frame(self._sock, frame)
                reply = recv_frame(self._sock)
            except (OSError, CheckpointError) as exc:
                raise CheckpointError(f"checkpoint saver at {self.path} failed: {exc}") from exc
        if reply is None or reply.get("id") != frame["id"]:
            raise CheckpointError(f"checkpoint saver at {self.path} sent no matching reply")
        if not reply.get("ok"):
            raise CheckpointError(str(reply.get("error", "checkpoint saver refused the request")))
        return reply

    def close(self) -> None:
        with self._lock:
            self._sock.close()
