"""``dlrover-hpc launch``: the job master here, one ``dlrover-run`` agent per host over SSH.

The flow:

1. hosts on a blocklist are skipped; every other host is reached over SSH at once (asyncssh,
   bounded fan-out, host keys checked against known_hosts) and starts the remote helper
   (:mod:`dlrover_hpc.ssh.remote`), which says hello with the host's own name;
2. hosts that cannot be reached are named; the job goes on while at least ``--nnodes`` MIN
   hosts remain;
3. the master runs in this process (``--drain=quarantine``); the first ``--nnodes`` MAX hosts
   start their agents, the rest are hot spares whose agents start once the first rendezvous
   completes, so they wait in rendezvous and take a lost node's place;
4. every host's output is streamed here with a ``host:`` prefix; hosts the master quarantines
   are written to the blocklists; Ctrl-C and SIGTERM are forwarded to the agents;
5. when the job ends, every helper exits (or is told to stop): nothing is left on the hosts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shlex
import signal
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any

from dlrover_hpc import environ
from dlrover_hpc.config import MasterConfig, NodeRange
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.jobdir import make_job_dir, resolve_token
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import SshCluster
from dlrover_hpc.master.server import MasterServer
from dlrover_hpc.master.stores import TorchStores
from dlrover_hpc.ssh.blocklist import BlockedHost, QuarantineReader, block_host, read_blocklist
from dlrover_hpc.ssh.errors import LaunchError
from dlrover_hpc.ssh.hostfile import HostEntry
from dlrover_hpc.ssh.plan import RunArgs, drop_blocked, job_nnodes, split_hosts, too_few_hosts
from dlrover_hpc.ssh.session import HostSession, Output, PrefixedOutput, SessionState, SshOptions

log = logging.getLogger(__name__)

FANOUT = 64  # SSH handshakes at once
POLL_S = 0.2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaunchConfig:
    hostfile: str
    hosts: tuple[HostEntry, ...]
    run: RunArgs
    spares: int = 0
    job_dir: Path
    job_id: str
    master: MasterConfig  # from the MASTER_OPTS variable; nnodes etc. are set here
    shared_blocklist: Path | None = None
    ssh: SshOptions = dataclasses.field(default_factory=SshOptions)
    remote_python: str
    cwd: str
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # for the agents
    agent_grace_s: float = 10.0  # stop: SIGTERM, then SIGKILL after this
    finish_grace_s: float = 30.0  # after the job ends, for agents to exit on their own
    spare_start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.spares < 0:
            raise ConfigError(f"--spares={self.spares}: must be 0 or more")

    @property
    def blocklists(self) -> tuple[Path, ...]:
        own = self.job_dir / "blocklist.txt"
        return (own,) if self.shared_blocklist is None else (own, self.shared_blocklist)

    def remote_command(self) -> str:
        return f"exec {shlex.quote(self.remote_python)} -m dlrover_hpc.ssh.remote"

    def agent_program(self) -> str:
        return str(Path(self.remote_python).parent / "dlrover-run")


class Launcher:
    def __init__(self, config: LaunchConfig, *, output: Output | None = None) -> None:
        self.config = config
        self._output = output or PrefixedOutput()
        self._signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
        self._signalled: signal.Signals | None = None
        self.sessions: list[HostSession] = []  # every host reached
        self._in_job: list[HostSession] = []  # the active hosts and spares
        self._blocked: dict[str, BlockedHost] = {}
        self._gone: set[str] = set()  # hosts the master lost
        self._token = ""
        self._port = 0
        self._master_host = ""
        self._nnodes = NodeRange(min=1, max=1)

    # ------------------------------------------------------------------- run
    async def run(self) -> int:
        cfg = self.config
        usable = self._usable_hosts()
        self._nnodes = job_nnodes(
            requested=cfg.run.nnodes, usable=len(usable), spares=cfg.spares, hostfile=cfg.hostfile
        )
        master_config = dataclasses.replace(
            cfg.master,
            nnodes=self._nnodes,
            max_restarts=cfg.run.max_restarts,
            node_unit=cfg.run.node_unit,
            segment=cfg.run.segment,
            job_dir=str(cfg.job_dir),
            job_id=cfg.job_id,
        )
        self._check_enough(len(usable), what="usable")
        job_dir = make_job_dir(cfg.job_dir)
        self._token = resolve_token(job_dir, create=True)
        log.info("launch job=%s job_dir=%s hosts=%d", cfg.job_id, job_dir, len(usable))
        self._install_signals()
        stores = asyncio.create_task(asyncio.to_thread(TorchStores))  # imports torch
        try:
            ready = await self._open_all(usable)
            if self._signalled is not None:
                return 128 + self._signalled
            active, spares = split_hosts(ready, nnodes=self._nnodes)
            self._in_job = active + spares
            self._log_plan(active, spares)
            master = build_master(master_config, SshCluster(), job_dir=job_dir, stores=await stores)
            server = MasterServer(master, token=self._token)
            self._port = await server.start()
            self._master_host = master.advertised_host
            return await self._run_job(server, active, spares)
        finally:
            stores.cancel()
            await self._close_all()

    def _usable_hosts(self) -> list[HostEntry]:
        for path in self.config.blocklists:
            for name, entry in read_blocklist(path).items():
                self._blocked.setdefault(name, entry)
        usable, skipped = drop_blocked(self.config.hosts, self._blocked)
        for host, b in skipped:
            log.warning("host skipped host=%s blocklisted at %s: %s", host.name, b.where, b.reason)
        return usable

    def _check_enough(self, count: int, *, what: str, problems: list[str] | None = None) -> None:
        if count >= self._nnodes.min:
            return
        _, skipped = drop_blocked(self.config.hosts, self._blocked)
        blocked = [f"{h.name}: blocklisted ({b.where}: {b.reason})" for h, b in skipped]
        raise too_few_hosts(
            count,
            what=what,
            hostfile=self.config.hostfile,
            total=len(self.config.hosts),
            nnodes=self._nnodes,
            problems=[*(problems or []), *blocked],
        )

    def _log_plan(self, active: list[HostSession], spares: list[HostSession]) -> None:
        log.info(
            "hosts active=%s spares=%s",
            ",".join(s.name for s in active),
            ",".join(s.name for s in spares) or "-",
        )
        if self.config.spares and len(spares) != self.config.spares:
            log.warning(
                "spares requested=%d available=%d (--nnodes=%s takes the first %d hosts)",
                self.config.spares,
                len(spares),
                self._nnodes,
                self._nnodes.max,
            )

    # --------------------------------------------------------------- connect
    async def _open_all(self, hosts: list[HostEntry]) -> list[HostSession]:
        cfg = self.config
        command = cfg.remote_command()
        self.sessions = [
            HostSession(h, ssh=cfg.ssh, output=self._output, remote_command=command) for h in hosts
        ]
        gate = asyncio.Semaphore(FANOUT)

        async def open_one(session: HostSession) -> str | None:
            async with gate:
                try:
                    await session.open()
                except LaunchError as exc:
                    return str(exc)
            return None

        opening = asyncio.create_task(_gather(*(open_one(s) for s in self.sessions)))
        signalled = asyncio.create_task(self._signals.get())
        either: set[asyncio.Future[Any]] = {opening, signalled}
        done, _ = await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if signalled in done:
            self._signalled = signalled.result()
            opening.cancel()
            return []
        signalled.cancel()
        errors = opening.result()
        problems = [e for e in errors if e]
        ready = [s for s, e in zip(self.sessions, errors, strict=True) if e is None]
        ready = self._drop_duplicates_and_blocked(ready, problems)
        self._check_enough(len(ready), what="reachable", problems=problems)
        for problem in problems:  # not fatal: the others go on without these hosts
            log.error("host not used: %s", problem)
        return ready

    def _drop_duplicates_and_blocked(
        self, ready: list[HostSession], problems: list[str]
    ) -> list[HostSession]:
        """Two hostfile lines may reach one machine; and a host's own name may be blocked."""
        seen: dict[str, str] = {}
        kept = []
        for s in ready:
            if s.node in self._blocked and s.node != s.name:
                b = self._blocked[s.node]
                problems.append(f"{s.name}: is {s.node}, blocklisted ({b.where}: {b.reason})")
            elif s.node in seen:
                problems.append(
                    f"{s.name}: is the same machine as {seen[s.node]} ({s.node}); list it once"
                )
            else:
                seen[s.node] = s.name
                kept.append(s)
                continue
            s.stop()
        return kept

    # ------------------------------------------------------------------- job
    def _spec(self, session: HostSession) -> dict[str, Any]:
        cfg = self.config
        argv = cfg.run.agent_argv(
            program=cfg.agent_program(),
            nnodes=self._nnodes,
            nproc=str(session.entry.slots or cfg.run.nproc_per_node),
            master=f"{self._master_host}:{self._port}",
            job_dir=str(cfg.job_dir),
        )
        return {
            "argv": argv,
            "env": {**cfg.env, environ.TOKEN: self._token},
            "cwd": cfg.cwd,
            "grace_s": cfg.agent_grace_s,
        }

    async def _run_job(
        self, server: MasterServer, active: list[HostSession], spares: list[HostSession]
    ) -> int:
        master = asyncio.create_task(server.serve(linger_s=5.0))
        for session in active:
            session.start(self._spec(session))
        spare_start = asyncio.create_task(self._start_spares(server, active, spares))
        quarantine = QuarantineReader(self.config.job_dir / "quarantine.jsonl")
        finished = asyncio.create_task(server.master.job.finished.wait())
        try:
            while not finished.done():
                self._mirror_quarantine(quarantine)
                if not self._signals.empty() and self._on_signal(
                    self._signals.get_nowait(), server
                ):
                    return 128 + (self._signalled or signal.SIGTERM)
                self._check_agents_left(server)
                await asyncio.wait({finished}, timeout=POLL_S)
            code = await master
            self._mirror_quarantine(quarantine)
            self._gone = self._unreachable(server)
            await self._wait_agents_exit(self._gone)
            self._mirror_quarantine(quarantine)
        finally:
            spare_start.cancel()
            finished.cancel()
            if not master.done():
                server.master.job.finish(1, "the launcher stopped")
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(master, 10)
        if self._signalled is not None:
            return 128 + self._signalled
        log.info("job finished exit_code=%d job_dir=%s", code, self.config.job_dir)
        return code

    async def _start_spares(
        self, server: MasterServer, active: list[HostSession], spares: list[HostSession]
    ) -> None:
        """Spares start once the first round is complete, so the master keeps them spare."""
        if not spares:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.spare_start_timeout_s
        while (
            server.master.job.round < 1
            and not any(s.ended for s in active)
            and not server.master.job.finished.is_set()
            and loop.time() < deadline
        ):
            await asyncio.sleep(POLL_S)
        if server.master.job.finished.is_set():
            return
        for session in spares:
            if session.state is SessionState.READY:
                session.start(self._spec(session))
        log.info("spares started hosts=%s", ",".join(s.name for s in spares))

    def _check_agents_left(self, server: MasterServer) -> None:
        """Bare metal has no replacement nodes: with fewer live agents than MIN, give up."""
        live = [s for s in self._in_job if s.state in (SessionState.READY, SessionState.RUNNING)]
        if len(live) >= self._nnodes.min:
            return
        ended = ", ".join(f"{s.name} (exit {s.exit_code})" for s in self._in_job if s.ended)
        server.master.job.finish(
            1,
            f"only {len(live)} agent(s) left and --nnodes={self._nnodes} needs "
            f"{self._nnodes.min}; agents ended on: {ended}",
        )

    def _mirror_quarantine(self, reader: QuarantineReader) -> None:
        """The master's quarantine list goes to the blocklists: never used again."""
        by_node = {s.node: s.name for s in self.sessions}
        for entry in reader.new_entries():
            host = by_node.get(entry.node, entry.node)
            for path in self.config.blocklists:
                block_host(path, host, reason=entry.reason, job=self.config.job_id)
            log.warning(
                "host blocklisted host=%s reason=%s blocklists=%s",
                host,
                entry.reason,
                ",".join(map(str, self.config.blocklists)),
            )

    def _unreachable(self, server: MasterServer) -> set[str]:
        """Hosts whose agents the master lost: their links may be cut, so nobody waits for
        them (their agents stop on their own once they miss the master)."""
        connected = {
            n.node
            for n in server.master.agents.status().nodes
            if n.state not in ("lost", "excluded")
        }
        return {s.name for s in self.sessions if s.node not in connected}

    async def _wait_agents_exit(self, unreachable: set[str]) -> None:
        """After the job: agents exit on their own; a signal or the grace ends the wait (the
        helpers of agents still running are then told to stop)."""
        for session in self.sessions:
            if session.state is SessionState.READY:
                session.stop()  # a spare that never started
        pending = [s.wait() for s in self.sessions if s.name not in unreachable]
        waiting = asyncio.create_task(_gather(*pending))
        signalled = asyncio.create_task(self._signals.get())
        either: set[asyncio.Future[Any]] = {waiting, signalled}
        # After a signal the agents were told to stop already: do not wait long for them.
        grace = self.config.agent_grace_s if self._signalled else self.config.finish_grace_s
        await asyncio.wait(either, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        waiting.cancel()

    # --------------------------------------------------------------- signals
    def _install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._signals.put_nowait, sig)  # only queues it

    def _on_signal(self, sig: signal.Signals, server: MasterServer) -> bool:
        """First signal: forward it and stop the job. Second: stop the agents now.
        Returns True when the launcher should return at once."""
        if self._signalled is None:
            self._signalled = sig
            log.warning("%s: forwarding it to the agents and stopping the job", sig.name)
            for session in self.sessions:
                if session.state is SessionState.RUNNING:
                    session.signal(sig.name)
                else:
                    session.stop()
            server.master.job.request_stop(sig.name)
            return False
        log.warning("%s again: stopping every agent now", sig.name)
        for session in self.sessions:
            session.stop()  # end of input: the helper stops its agent
        return True

    async def _close_all(self) -> None:
        """Closing a channel makes the helper stop its agent; wait for that, then disconnect.
        Hosts the master lost are not waited for: their connection may hang on a cut link."""
        for session in self.sessions:
            session.stop()
        live = [s for s in self.sessions if not s.ended and s.name not in self._gone]
        if live:
            grace = self.config.agent_grace_s + 5.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_gather(*(s.wait() for s in live)), grace)
        await asyncio.gather(
            *(s.close(timeout_s=0 if s.name in self._gone else 5) for s in self.sessions)
        )


async def _gather(*aws: Awaitable[Any]) -> list[Any]:
    """gather() in a coroutine: cancelling it leaves no 'exception never retrieved' behind."""
    return await asyncio.gather(*aws)
