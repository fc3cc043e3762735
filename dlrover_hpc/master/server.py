"""The job master's asyncio TCP server: accept, authenticate, dispatch, push."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import resource
import sys
import time
from collections.abc import Awaitable
from typing import Any

from dlrover_hpc.errors import ProtocolError
from dlrover_hpc.master import batch_host, failover, stopping
from dlrover_hpc.master.assembly import Master
from dlrover_hpc.master.connection import AgentConnection
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol import wire
from dlrover_hpc.protocol.keepalive import set_link_timeout, unacknowledged_s

log = logging.getLogger(__name__)

#: ``dlrover-hpc master`` exits with this when another master serves the job (EX_TEMPFAIL):
#: the job scripts stop restarting the master step then.
SUPERSEDED = 75


def _error_reply(frame: wire.Frame, exc: Exception) -> m.ErrorReply:
    """A request's failure as its answer: the master keeps serving."""
    if isinstance(exc, ProtocolError | KeyError | ValueError):
        return m.ErrorReply(message=str(exc))
    log.error("request failed type=%s", frame.type, exc_info=exc)
    return m.ErrorReply(message=f"internal error: {exc}")


#: files the master holds beside one connection per agent (logs, journal, stores, clients)
SPARE_FILES = 512


#: Python's collector, as the master sets it: full collections after 1,000 collections of the
#: middle generation, not 10.  Every rank's progress lives one heartbeat (seconds), long enough
#: to reach the oldest generation; at 4,096 nodes a full collection of the master's million
#: objects then came every few seconds, each tens of milliseconds with no request answered
#: (heartbeat p99 320 ms, and 0.07 of a core).  Refcounting frees them all the same.
GC_THRESHOLDS = (700, 10, 1000)


def quiet_collector() -> None:
    """Fewer full collections, and none over what exists at start (imports, config)."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


def raise_open_files_limit(nodes: int) -> None:
    """One connection per agent: the soft limit on open files (1,024 by default on many
    clusters) would refuse agents past about a thousand.  Raise it to the hard limit, and say
    so when even that is short of ``nodes`` connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = nodes + SPARE_FILES
    if soft < want and soft != hard:
        new = hard if hard == resource.RLIM_INFINITY else min(hard, max(want, soft))
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d: %s", soft, exc)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "open-files limit %d is short of %d (one connection per node, up to %d nodes): "
            "agents past it are refused; raise the hard limit (ulimit -Hn, or Slurm's "
            "PropagateResourceLimits)",
            soft,
            want,
            nodes,
        )


class MasterServer:
    """Serves one assembled :class:`Master` (:func:`build_master`) to the agents: listens,
    authenticates with the job ``token``, dispatches each request to the master's handler and
    pushes the master's messages to the agent's connection."""

    def __init__(self, master: Master, *, token: str):
        self.master = master
        self.config = master.config
        self._token = token
        master.sender = self.push
        self._writers: dict[str, AgentConnection] = {}  # agent id -> its newest connection
        self._server: asyncio.base_events.Server | None = None
        self._listener_link_timeout = False  # accepted connections inherit the link timeout
        self._pending: set[asyncio.Future[Any]] = set()  # requests whose answer waits
        self.port = 0
        self._handlers = master.requests()

    async def start(self) -> int:
        raise_open_files_limit(self.config.nnodes.max)
        quiet_collector()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._accept, self.config.host, self.config.port, backlog=4096, start_serving=False
        )
        # Set on the listening sockets, the link timeout is every accepted connection's from
        # the kernel (Linux copies keepalive and TCP_USER_TIMEOUT into them): five fewer
        # system calls per agent, 16,384 of them in a rendezvous.
        self._listener_link_timeout = sys.platform == "linux" and all(
            set_link_timeout(sock, self.config.link_timeout_in_use_s, peer="listening")
            for sock in self._server.sockets
        )
        await self._server.start_serving()
        self.port = self._server.sockets[0].getsockname()[1]
        self.master.listening(self.port)
        log.info(
            "master listening host=%s port=%d job_dir=%s loop=%s",
            self.master.advertised_host,
            self.port,
            self.master.job_dir,
            type(asyncio.get_running_loop()).__module__.split(".")[0],
        )
        return self.port

    def push(self, agent_id: str, message: m.Message) -> None:
        conn = self._writers.get(agent_id)
        if conn is not None:
            conn.write(wire.encode(m.to_frame(message)))

    def _accept(self) -> AgentConnection:
        on_made = None
        if not self._listener_link_timeout:  # else: the listening socket's, inherited
            # A cut link sends no FIN: keepalive and TCP_USER_TIMEOUT make it an error in time.
            def on_made(sock: Any) -> None:
                set_link_timeout(sock, self.config.link_timeout_in_use_s, peer="accepted")

        return AgentConnection(self, self._token, on_made=on_made)

    def frame(self, conn: AgentConnection, frame: wire.Frame) -> None:
        """A request on an authenticated connection: answered now, or when its future is."""
        answer = self._answer(frame, conn)
        if isinstance(answer, m.Message):  # answered at once (a heartbeat, a join)
            conn.write(wire.encode(m.to_frame(answer, frame_id=frame.id)))
            return
        msg, pending = answer
        fut = asyncio.ensure_future(pending)  # a future as it is; a coroutine as a task
        self._pending.add(fut)
        fut.add_done_callback(functools.partial(self._reply_later, frame, msg, conn))

    def closed(self, conn: AgentConnection, *, link_timed_out: bool) -> None:
        """``conn`` ended; ``link_timed_out``: it was silent for the link timeout."""
        for agent_id in conn.agent_ids:
            if self._writers.get(agent_id) is conn:
                del self._writers[agent_id]
                self.master.agents.disconnected(agent_id, link_timed_out=link_timed_out)

    def _answer(
        self, frame: wire.Frame, conn: AgentConnection
    ) -> m.Message | tuple[m.Message, Awaitable[Any]]:
        """The reply to ``frame`` when its handler answers at once (most requests); else the
        request and what its reply waits on (a join, a checkpoint commit)."""
        try:
            msg = m.from_frame(frame)
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{frame.type!r} is not a request the master serves")
            result = handler(msg)
            if isinstance(result, Awaitable):
                return msg, result
            self._note_agent(msg, result, conn)
            reply: m.Message = result
            return reply
        except Exception as exc:
            return _error_reply(frame, exc)

    def _reply_later(
        self,
        frame: wire.Frame,
        msg: m.Message,
        conn: AgentConnection,
        fut: asyncio.Future[Any],
    ) -> None:
        self._pending.discard(fut)
        reply: m.Message
        if fut.cancelled():
            reply = m.ErrorReply(message="request superseded")
        elif (exc := fut.exception()) is not None:
            reply = (
                _error_reply(frame, exc)
                if isinstance(exc, Exception)
                else m.ErrorReply(message=f"internal error: {exc!r}")
            )
        else:
            result = fut.result()
            self._note_agent(msg, result, conn)
            reply = result
        conn.write(wire.encode(m.to_frame(reply, frame_id=frame.id)))

    def _note_agent(self, msg: m.Message, result: Any, conn: AgentConnection) -> None:
        """Pushes to an agent go over the connection it last spoke on."""
        agent_ids = conn.agent_ids
        if isinstance(msg, m.Join):
            agent_ids.add(result.agent_id)
            self._writers[result.agent_id] = conn
        elif (agent_id := getattr(msg, "agent_id", None)) and agent_id not in agent_ids:
            agent_ids.add(agent_id)  # a re-connected agent
            self._writers[agent_id] = conn

    async def _liveness(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            self.master.agents.check_liveness()  # O(nodes): on this timer only, not on every change
            self.master.agents.check_capacity()
            self.master.agents.say_waiting()
            try:
                self.master.hangs.check()
            except Exception:  # a bug in a detector must not end the liveness checks
                log.exception("hang and straggler check failed")
            self.master.stopper.check()
            try:
                self.master.auto_persist.check()
            except Exception:  # a bug here must not end the liveness checks either
                log.exception("--persist-every check failed")
            self.master.job.poke()

    async def _link_ticks(self, every_s: float) -> None:
        """A tick to every agent each ``every_s``: a cut link then always has bytes in flight,
        not only at the keepalive's next whole-second probe.  Before each tick, a link whose
        peer has acknowledged nothing for ``link_timeout_s`` while data waits is closed as
        timed out (the survivors' collectives wait that long): the kernel's TCP_USER_TIMEOUT
        would fail it one retransmission timeout later (:func:`unacknowledged_s`)."""
        tick = wire.encode(m.to_frame(m.LinkTick()))
        timeout_s = self.config.link_timeout_in_use_s
        while True:
            await asyncio.sleep(every_s)
            for conn in set(self._writers.values()):
                transport = conn.transport
                if transport is None or transport.is_closing():
                    continue
                silent_s = unacknowledged_s(transport.get_extra_info("socket"))
                if silent_s is not None and silent_s >= timeout_s:
                    log.warning(
                        "link silent peer=%s unacknowledged_s=%.2f link_timeout_s=%g: closing",
                        conn.peer,
                        silent_s,
                        timeout_s,
                    )
                    conn.silent = True
                    transport.abort()  # the connection ends; its agent is lost at once
                    continue
                # Bytes still queued here: the kernel has data in flight already.
                if not transport.get_write_buffer_size():
                    transport.write(tick)

    async def _lease(self) -> None:
        """Renew the lease; step down when a newer master claimed the job (fencing)."""
        while True:
            await asyncio.sleep(failover.LEASE_EVERY_S)
            if not await asyncio.to_thread(self.master.renew_lease):
                self.master.job.finished.set()  # the job goes on under the new master
                return

    async def serve(self, linger_s: float = 10.0) -> int:
        """Run until the job finishes, give agents ``linger_s`` to hear it, return the exit code
        (:data:`SUPERSEDED` when a newer master took the job over)."""
        if self._server is None:
            await self.start()
        master = self.master
        live = asyncio.create_task(self._liveness())
        tick_s = self.config.link_tick_s
        ticks = asyncio.create_task(self._link_ticks(tick_s) if tick_s else asyncio.sleep(0))
        lease = asyncio.create_task(self._lease())
        relaunches = asyncio.create_task(
            master.relauncher.run() if master.relauncher else asyncio.sleep(0)
        )
        time_left = asyncio.create_task(stopping.watch_time_left(master.stopper))
        states = asyncio.create_task(
            master.node_states.run() if master.node_states else asyncio.sleep(0)
        )
        try:
            await master.job.run()
            relaunches.cancel()
            if master.superseded:
                return SUPERSEDED
            if master.replacer is not None:
                await asyncio.to_thread(master.replacer.cancel_all)
            loop = asyncio.get_running_loop()
            if master.stopper.plan is not None:  # the agents persist the newest step first
                linger_s = max(linger_s, min(120.0, master.stopper.plan.deadline - time.time()))
            deadline = loop.time() + linger_s
            while self._writers and loop.time() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.to_thread(master.stopper.conclude)
            await asyncio.to_thread(
                batch_host.end_orphaned_job,
                self.config.job_id,
                exit_code=master.job.exit_code or 0,
                emit=master.job.emit,
            )
        finally:
            time_left.cancel()
            states.cancel()
            live.cancel()
            ticks.cancel()
            lease.cancel()
            relaunches.cancel()
            if master.relauncher is not None and not master.superseded:  # did not hear the end
                await asyncio.to_thread(master.relauncher.launcher.stop_all)
            await self.close()
        return master.job.exit_code or 0

    async def close(self) -> None:
        await asyncio.to_thread(self.master.stop_metrics)
        if self._server is not None:
            self._server.close()
            for conn in list(self._writers.values()):
                conn.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
        for fut in list(self._pending):
            fut.cancel()
