"""One agent's connection to the job master, as an asyncio Protocol.

Frames are cut from the bytes in ``data_received`` (:class:`wire.FrameBuffer`) and answered
there: no stream reader, no read task and no await per frame.  A request answered at once (a
heartbeat, a join) is written back in the same callback; one whose answer waits (a WaitRound,
a stack collection) is answered from its future's callback.  At 4,096 nodes the master reads
2,048 heartbeats a second, and 16,384 joins in a rendezvous: a stream reader costs each two
wake-ups of the connection's task and a future per ``readexactly``.

The wire is unchanged (:mod:`dlrover_hpc.protocol.wire`): the challenge, ``auth`` within
``AUTH_TIMEOUT_S`` and at most ``MAX_AUTH_FRAME`` bytes, ``auth_ok`` or ``auth_failed``, then
frames answered with their id.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.protocol import wire

log = logging.getLogger(__name__)

AUTH_TIMEOUT_S = 10.0
#: A connection that failed with these saw no answer for the link timeout: no reconnect grace.
LINK_ERRNOS = frozenset({errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH})
#: replies queued to one agent past this: stop reading its requests until they are sent
DRAIN_ABOVE = 256 * 1024


class Serving(Protocol):
    """What a connection needs of its server (:class:`~dlrover_hpc.master.server.MasterServer`)."""

    def frame(self, conn: AgentConnection, frame: wire.Frame) -> None: ...

    def closed(self, conn: AgentConnection, *, link_timed_out: bool) -> None: ...


class AgentConnection(asyncio.Protocol):
    """An agent's TCP connection: authenticates it with the job ``token``, hands each frame to
    ``server.frame`` and its end to ``server.closed``."""

    def __init__(
        self, server: Serving, token: str, *, on_made: Callable[[Any], None] | None = None
    ) -> None:
        self.server = server
        self._token = token
        self._on_made = on_made  # the accepted socket, before anything is sent on it
        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        self.agent_ids: set[str] = set()  # the agents that spoke on it (pushes go here)
        self.silent = False  # closed by the link ticks: its link was silent
        self._frames = wire.FrameBuffer()
        self._nonce = ""
        self._authed = False
        self._refused = False
        self._auth_timer: asyncio.TimerHandle | None = None
        self._error: str | None = None

    # ------------------------------------------------------------- as a writer
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def send(self, frame: wire.Frame) -> None:
        self.write(wire.encode(frame))

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if self.transport is None:
            return default
        return self.transport.get_extra_info(name, default)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # ------------------------------------------------------------- the protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport's subclasses: no isinstance check.
        self.transport = tcp = cast(asyncio.Transport, transport)
        self.peer = tcp.get_extra_info("peername")
        if self._on_made is not None:
            self._on_made(tcp.get_extra_info("socket"))
        # Past this, reading stops until the agent takes its replies (a slow reader).
        tcp.set_write_buffer_limits(high=DRAIN_ABOVE)
        self._nonce = wire.new_nonce()
        self.send(wire.Frame(type="challenge", body={"nonce": self._nonce}))
        loop = asyncio.get_running_loop()
        self._auth_timer = loop.call_later(AUTH_TIMEOUT_S, self._auth_expired)

    def data_received(self, data: bytes) -> None:
        frames = self._frames
        frames.feed(data)
        transport = self.transport
        assert transport is not None
        try:
            while not transport.is_closing():
                if not self._authed:
                    payload = frames.pop(limit=wire.MAX_AUTH_FRAME)
                    if payload is None:
                        return
                    self._authenticate(wire.decode(payload))
                    continue
                payload = frames.pop()
                if payload is None:
                    return
                self.server.frame(self, wire.decode(payload))
        except ProtocolError as exc:
            self._fail(str(exc))

    def eof_received(self) -> bool | None:
        if not self._authed:
            self._fail("connection closed")
        elif len(self._frames):
            self._error = "connection closed inside a frame"
        return None  # the transport closes itself

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
        if not self._authed:
            if not self._refused:
                reason = f"no valid auth answer ({exc or self._error or 'connection closed'})"
                log.warning("connection refused peer=%s reason=%s", self.peer, reason)
            return
        timed_out = False
        if exc is not None or self._error is not None:
            log.warning("connection dropped peer=%s error=%s", self.peer, exc or self._error)
            # The keepalive / user timeout gave up: the link was silent for --link-timeout.
            timed_out = isinstance(exc, OSError) and exc.errno in LINK_ERRNOS
        self.server.closed(self, link_timed_out=timed_out or self.silent)

    # ------------------------------------------------------------- authentication
    def _authenticate(self, answer: wire.Frame) -> None:
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        if answer.type != "auth" or not wire.check_digest(
            self._token, self._nonce, answer.body.get("digest")
        ):
            log.warning("connection refused peer=%s reason=bad job token", self.peer)
            self._refused = True
            self.send(wire.Frame(type="auth_failed", body={"error": "bad job token"}))
            self.close()
            return
        self._authed = True
        self.send(wire.Frame(type="auth_ok"))

    def _auth_expired(self) -> None:
        self._auth_timer = None
        if not self._authed:
            self._fail(f"no answer in {AUTH_TIMEOUT_S:g} s")

    def _fail(self, reason: str) -> None:
        """A frame the wire refuses (or no auth answer): the connection ends."""
        self._error = reason
        if self.transport is not None:
            self.transport.abort()
