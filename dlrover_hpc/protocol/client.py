"""An authenticated, multiplexed connection to the job master (used by agents and tools)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from typing import TypeVar

from dlrover_hpc.config import DEFAULT_LINK_TIMEOUT_S
from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.keepalive import set_link_timeout

log = logging.getLogger(__name__)
M = TypeVar("M", bound=m.Message)


class MasterClient:
    """Requests carry an id and a timeout; pushes from the master land in :attr:`pushes`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pushes: asyncio.Queue[m.Message] | None = None,
    ) -> None:
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[m.Message]] = {}
        #: shared by the successive connections of a reconnecting caller
        self.pushes: asyncio.Queue[m.Message] = pushes if pushes is not None else asyncio.Queue()
        self.closed = asyncio.Event()
        self._reader_task = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        token: str,
        timeout_s: float = 10.0,
        link_timeout_s: float | None = DEFAULT_LINK_TIMEOUT_S,
        pushes: asyncio.Queue[m.Message] | None = None,
    ) -> MasterClient:
        """Connect and authenticate.  ``link_timeout_s``: a master silent for this long (a cut
        link) fails the connection (TCP keepalive, TCP_USER_TIMEOUT); None leaves the kernel's
        defaults (then only request timeouts notice it)."""
        # asyncio.timeout, not wait_for: no task of its own per call (16,384 agents connect)
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port, limit=wire.MAX_FRAME)
        if link_timeout_s is not None:
            set_link_timeout(writer.get_extra_info("socket"), link_timeout_s, peer=f"{host}:{port}")
        try:
            await wire.client_handshake(reader, writer, token, timeout_s)
        except BaseException:
            writer.close()
            raise
        return cls(reader, writer, pushes)

    def set_link_timeout(self, link_timeout_s: float) -> None:
        """Change this connection's link timeout (the master told a longer one)."""
        sock = self._writer.get_extra_info("socket")
        set_link_timeout(sock, link_timeout_s, peer=self._writer.get_extra_info("peername"))

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionError("connection to the master closed")
        try:
            while True:
                frame = await wire.read_frame(self._reader)
                if frame.type == m.LinkTick.TYPE:  # only there to be acknowledged by the kernel
                    continue
                message = m.from_frame(frame)
                if frame.id is None:
                    self.pushes.put_nowait(message)
                    continue
                fut = self._pending.pop(frame.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(message)
        except (EOFError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except OSError as exc:  # ETIMEDOUT, EHOSTUNREACH: the link timeout expired
            log.warning("connection to the master lost error=%s", exc)
            error = ConnectionError(f"connection to the master lost: {exc}")
        except ProtocolError as exc:
            log.error("bad frame from the master error=%s", exc)
            error = exc
        finally:
            self.closed.set()
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError(str(error)))
            self._pending.clear()

    async def request(self, message: m.Message, reply_type: type[M], *, timeout_s: float) -> M:
        if self.closed.is_set():
            raise ConnectionError("connection to the master closed")
        frame_id = next(self._ids)
        fut: asyncio.Future[m.Message] = asyncio.get_running_loop().create_future()
        self._pending[frame_id] = fut
        try:
            wire.write_frame(self._writer, m.to_frame(message, frame_id=frame_id))
            await self._writer.drain()
        except OSError as exc:  # ETIMEDOUT, EHOSTUNREACH: callers expect a ConnectionError
            self._pending.pop(frame_id, None)
            if isinstance(exc, ConnectionError):
                raise
            raise ConnectionError(f"connection to the master lost: {exc}") from exc
        try:
            async with asyncio.timeout(timeout_s):
                reply = await fut
        except TimeoutError:
            raise TimeoutError(
                f"the master did not answer {message.TYPE!r} within {timeout_s:.0f} s"
            ) from None
        finally:
            self._pending.pop(frame_id, None)
        return m.expect(reply, reply_type)

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader_task
