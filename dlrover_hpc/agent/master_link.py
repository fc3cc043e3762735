"""The agent's connection to the master, kept up across drops.

A dropped connection (a cut link that came back, a master that restarted, a connection reset)
is not the end of the node's part in the job: the agent's workers train on while it connects
again with back-off and re-registers under the same agent id.  The master then either still
counts the node (nothing changed) or has re-formed the round without it, and tells it so in
the next heartbeat reply (the node re-joins as a spare: ``node_readmitted``).  Requests made
while the connection is down wait for the new one and are sent again; only when no connection
came back within ``--reconnect-timeout`` do they fail, and the agent stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient

log = logging.getLogger(__name__)
M = TypeVar("M", bound=m.Message)

#: Back-off between reconnect attempts: 0.25, 0.5, 1, 1 ... seconds, each +-20 % so that
#: thousands of agents do not knock at once; short, since a restarted master is back in seconds
#: and every second the agents wait for it counts as the job's downtime.  A refused connect
#: costs the master's host one SYN and one RST: 16k agents once a second is nothing.
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 1.0

Connect = Callable[[asyncio.Queue[m.Message]], Awaitable[MasterClient]]
Register = Callable[[MasterClient], Awaitable[None]]


class MasterLink:
    """``request`` over whichever connection is up; :attr:`pushes` outlives connections."""

    def __init__(self, connect: Connect, register: Register, *, reconnect_timeout_s: float):
        self._connect, self._register = connect, register
        self._reconnect_timeout_s = reconnect_timeout_s
        self.pushes: asyncio.Queue[m.Message] = asyncio.Queue()
        self.client: MasterClient | None = None
        self._up = asyncio.Event()
        self.gone = asyncio.Event()  # set when no connection came back in time
        self.reconnects = 0
        self.down_since: float | None = None  # monotonic, while no connection is up
        self.lost_at = 0.0  # wall clock of the newest drop (0: none yet)
        self._watch: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """The first connection; its errors go to the caller (a wrong address is not a drop)."""
        client = await self._connect(self.pushes)
        try:
            await self._register(client)
        except BaseException:
            await client.close()
            raise
        self.client = client
        self._up.set()
        self._watch = asyncio.create_task(self._keep_up())

    async def _keep_up(self) -> None:
        while True:
            assert self.client is not None
            await self.client.closed.wait()
            self._up.clear()
            self.down_since, self.lost_at = time.monotonic(), time.time()
            log.warning(
                "connection to the master dropped; reconnecting for up to %.0f s "
                "(workers keep training)",
                self._reconnect_timeout_s,
            )
            if not await self._reconnect():
                log.error(
                    "no connection to the master for %.0f s; giving up", self._reconnect_timeout_s
                )
                self.gone.set()
                return

    async def _reconnect(self) -> bool:
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self._reconnect_timeout_s
        delay, attempts = RETRY_FIRST_S, 0
        while loop.time() < deadline:
            attempts += 1
            client: MasterClient | None = None
            try:
                client = await self._connect(self.pushes)
                await self._register(client)
            except (OSError, TimeoutError, ProtocolError) as exc:  # ConnectionError is an OSError
                if client is not None:
                    await client.close()
                log.info("reconnect attempt=%d failed error=%s", attempts, exc)
                pause = delay * random.uniform(0.8, 1.2)
                await asyncio.sleep(max(0.0, min(pause, deadline - loop.time())))
                delay = min(RETRY_MAX_S, delay * 2)
                continue
            old, self.client = self.client, client
            if old is not None:
                await old.close()
            self.reconnects += 1
            self.down_since = None
            self._up.set()
            log.warning(
                "reconnected to the master after %.1f s attempts=%d",
                loop.time() - started,
                attempts,
            )
            return True
        return False

    async def request(self, message: m.Message, reply_type: type[M], *, timeout_s: float) -> M:
        """Send ``message``; after a drop, again over the new connection.  Raises
        ConnectionError once the link is gone for good, TimeoutError after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            await self._wait_up(deadline, message)
            client = self.client
            assert client is not None
            try:
                return await client.request(
                    message, reply_type, timeout_s=max(0.1, deadline - loop.time())
                )
            except ConnectionError:
                if self.gone.is_set():
                    raise
                if client is self.client:  # the drop is news here: wait for _keep_up
                    self._up.clear()
                    if not client.closed.is_set():  # a failed write: make the drop official
                        await client.close()

    async def _wait_up(self, deadline: float, message: m.Message) -> None:
        if self._up.is_set():
            return
        if self.gone.is_set():
            raise ConnectionError("the connection to the master is gone")
        up = asyncio.create_task(self._up.wait())
        gone = asyncio.create_task(self.gone.wait())
        try:
            remaining = deadline - asyncio.get_running_loop().time()
            done, _ = await asyncio.wait(
                {up, gone}, timeout=max(0.0, remaining), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            up.cancel()
            gone.cancel()
        if self.gone.is_set():
            raise ConnectionError("the connection to the master is gone")
        if not done:
            raise TimeoutError(f"no connection to the master to send {message.TYPE!r}")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.client is not None:
            await self.client.close()
