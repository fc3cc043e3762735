"""Framing and authentication on the master's TCP connections.

A frame is a 4-byte big-endian length followed by a UTF-8 JSON object
``{"v": VERSION, "type": ..., "id": ..., "body": {...}}``.  Never pickle.  ``id`` pairs a reply
with its request; server pushes carry ``id: null``.

Authentication (both sides hold the job token, :data:`environ.TOKEN`): the server sends
``challenge`` with a random nonce; the client answers ``auth`` with
``HMAC-SHA256(token, "dlrover-hpc/v1" + nonce)``; the server answers ``auth_ok`` or closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import secrets
import struct
from typing import Any

import orjson

from dlrover_hpc import environ
from dlrover_hpc.errors import AuthError, ProtocolError

VERSION = 1
MAX_FRAME = 16 * 1024 * 1024
#: the largest frame a peer may send before it is authenticated (its ``auth`` answer): an
#: unknown peer cannot make the master hold more than this per connection
MAX_AUTH_FRAME = 4096
_HEADER = struct.Struct(">I")
_AUTH_CONTEXT = b"dlrover-hpc/v1"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Frame:
    type: str
    id: int | None = None
    body: dict[str, Any] = dataclasses.field(default_factory=dict)


def encode(frame: Frame) -> bytes:
    try:
        body = orjson.dumps(frame.body)  # a sixth of json's time: four frames per agent's join
    except TypeError:  # an integer past 64 bits, a key that is not a string
        body = b"null"
    if b"null" in body:
        # orjson writes NaN and Infinity as null, which a float field refuses: json writes
        # them as a peer reads them back (a None is null either way).
        body = json.dumps(frame.body, separators=(",", ":")).encode()
    # The frame around its body as json and orjson write it (a push's id: null, not a
    # reason to write the body twice: a challenge and an auth_ok per agent's join).
    fid = b"null" if frame.id is None else str(int(frame.id)).encode()
    payload = b'{"v":%d,"type":%b,"id":%b,"body":%b}' % (
        VERSION,
        orjson.dumps(frame.type),
        fid,
        body,
    )
    if len(payload) > MAX_FRAME:
        raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME} byte limit")
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes) -> Frame:
    try:
        obj = orjson.loads(payload)  # a fourth of json's time: the master's busiest path
    except orjson.JSONDecodeError:
        # What orjson refuses and json reads (NaN, Infinity, integers past 64 bits, deep
        # nesting) reads as before; what neither reads is an error.
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." too deep
            raise ProtocolError(f"frame is not JSON: {type(exc).__name__}: {exc}"[:300]) from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION:
        version = obj.get("v") if isinstance(obj, dict) else None
        raise ProtocolError(f"unsupported protocol version {version!r}; this side speaks {VERSION}")
    kind, fid, body = obj.get("type"), obj.get("id"), obj.get("body", {})
    if not isinstance(kind, str) or not isinstance(body, dict):
        raise ProtocolError("frame lacks a string 'type' or an object 'body'")
    if fid is not None and not isinstance(fid, int):
        raise ProtocolError(f"frame id must be an integer, got {fid!r}")
    return Frame(type=kind, id=fid, body=body)


async def read_frame(reader: asyncio.StreamReader, *, limit: int = MAX_FRAME) -> Frame:
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            raise EOFError("connection closed") from None
        raise ProtocolError("connection closed inside a frame header") from None
    (length,) = _HEADER.unpack(header)
    if length > limit:
        raise ProtocolError(f"peer announced a {length} byte frame (limit {limit})")
    try:
        payload = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise ProtocolError("connection closed inside a frame") from None
    return decode(payload)


class FrameBuffer:
    """Frames cut from a connection's bytes as they arrive (an asyncio Protocol's
    ``data_received``): no stream reader, read task or await per frame.  The master reads
    2,048 heartbeats a second at 4,096 nodes, and 16,384 joins in a rendezvous."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pop(self, *, limit: int = MAX_FRAME) -> bytes | None:
        """The next whole frame's payload, None until its bytes are all in; ProtocolError for
        a frame announced longer than ``limit``."""
        buf = self._buf
        if len(buf) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(buf)
        if length > limit:
            raise ProtocolError(f"peer announced a {length} byte frame (limit {limit})")
        end = _HEADER.size + length
        if len(buf) < end:
            return None
        payload = bytes(buf[_HEADER.size : end])
        del buf[:end]
        return payload

    def __len__(self) -> int:
        """Bytes held: a frame cut short when its connection ends, unless 0."""
        return len(self._buf)


def write_frame(writer: asyncio.StreamWriter, frame: Frame) -> None:
    writer.write(encode(frame))


def new_nonce() -> str:
    return secrets.token_hex(16)


def auth_digest(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), _AUTH_CONTEXT + nonce.encode(), hashlib.sha256).hexdigest()


def check_digest(token: str, nonce: str, digest: object) -> bool:
    return isinstance(digest, str) and hmac.compare_digest(auth_digest(token, nonce), digest)


async def client_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str, timeout_s: float
) -> None:
    """Answer the server's challenge; raises AuthError if the server refuses the token."""
    try:
        async with asyncio.timeout(timeout_s):
            challenge = await read_frame(reader)
    except EOFError:  # an OSError, as a refused connection is: the callers report both alike
        raise ConnectionResetError(
            "the master closed the connection before its challenge (ending, or restarting)"
        ) from None
    if challenge.type != "challenge" or not isinstance(challenge.body.get("nonce"), str):
        raise ProtocolError(f"expected a challenge from the master, got {challenge.type!r}")
    write_frame(
        writer, Frame(type="auth", body={"digest": auth_digest(token, challenge.body["nonce"])})
    )
    await writer.drain()
    try:
        async with asyncio.timeout(timeout_s):
            answer = await read_frame(reader)
    except EOFError:
        raise AuthError("the master closed the connection: the job token was refused") from None
    if answer.type != "auth_ok":
        raise AuthError(
            f"the master refused the job token ({answer.body.get('error', answer.type)}); "
            f"check {environ.TOKEN} matches the master's"
        )
