"""One host's SSH session: connect, start the remote helper, stream its output, stop it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
from enum import Enum
from typing import Any, Protocol

import asyncssh

from dlrover_hpc.errors import ConfigError
from dlrover_hpc.ssh import remote
from dlrover_hpc.ssh.errors import LaunchError
from dlrover_hpc.ssh.hostfile import HostEntry

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 60.0  # the helper's Python start on a busy host
CONNECTION_LOST = 255  # what ssh(1) returns when the connection drops


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SshOptions:
    """How to reach the hosts; unset values come from ``~/.ssh/config`` and the defaults."""

    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None  # None: ~/.ssh/known_hosts (or UserKnownHostsFile)
    config: str | None = None  # None: ~/.ssh/config
    port: int | None = None
    connect_timeout_s: float = 10.0
    keepalive_interval_s: float = 5.0
    keepalive_count_max: int = 3

    def __post_init__(self) -> None:
        if self.connect_timeout_s <= 0:
            raise ConfigError(f"SSH connect timeout {self.connect_timeout_s} s: must be > 0")
        if self.keepalive_interval_s <= 0 or self.keepalive_count_max < 1:
            raise ConfigError("SSH keepalive interval must be > 0 s and its count at least 1")

    def connect_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "connect_timeout": self.connect_timeout_s,
            "keepalive_interval": self.keepalive_interval_s,
            "keepalive_count_max": self.keepalive_count_max,
        }
        if self.user:
            kwargs["username"] = self.user
        if self.key:
            kwargs["client_keys"] = [self.key]
        if self.known_hosts:
            kwargs["known_hosts"] = self.known_hosts
        if self.config:
            kwargs["config"] = [self.config]
        if self.port:
            kwargs["port"] = self.port
        return kwargs


class Output(Protocol):
    """Where the hosts' output goes (one call per line)."""

    def line(self, host: str, text: str, *, stderr: bool) -> None: ...


class PrefixedOutput:
    """``host: line`` on our stdout or stderr, like pdsh."""

    def line(self, host: str, text: str, *, stderr: bool) -> None:
        stream = sys.stderr if stderr else sys.stdout
        # A closed pipe (`| head`) must not stop the job: the channels are still drained.
        with contextlib.suppress(OSError, ValueError):
            stream.write(f"{host}: {text}\n")
            stream.flush()


class SessionState(Enum):
    NEW = "new"
    READY = "ready"  # the helper said hello and waits for its start line
    RUNNING = "running"  # the agent runs
    ENDED = "ended"


def connect_error(host: str, exc: BaseException, ssh: SshOptions) -> str:
    """What went wrong reaching ``host``, and what to do about it."""
    if isinstance(exc, asyncssh.HostKeyNotVerifiable):
        where = ssh.known_hosts or "~/.ssh/known_hosts"
        return (
            f"{host}: the SSH host key is not trusted: no matching key in {where}; if {host} "
            f"is the right machine, add its key (check the fingerprint of 'ssh-keyscan {host}', "
            f"then append it to {where})"
        )
    if isinstance(exc, asyncssh.PermissionDenied):
        user = ssh.user or "your user name"
        return (
            f"{host}: SSH login refused for {user} (permission denied); check --ssh-user, "
            f"--ssh-key and {host}'s authorized_keys"
        )
    if isinstance(exc, TimeoutError):
        return (
            f"{host}: unreachable: no SSH answer within {ssh.connect_timeout_s:g} s; check that "
            "it is up and reachable from here, or remove it from the hostfile"
        )
    if isinstance(exc, socket.gaierror):
        return f"{host}: unknown host name ({exc.strerror}); fix the hostfile or ~/.ssh/config"
    if isinstance(exc, OSError):
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        return (
            f"{host}: unreachable: {why}; check that it is up and sshd runs, or remove it "
            "from the hostfile"
        )
    if isinstance(exc, asyncssh.Error):
        return f"{host}: SSH failed: {exc.reason}"
    return f"{host}: SSH failed: {exc!r}"


def describe_exit(code: int) -> str:
    if code == CONNECTION_LOST:
        return " (the SSH connection was lost)"
    if code > 128:
        with contextlib.suppress(ValueError):
            return f" (killed by {signal.Signals(code - 128).name})"
    return ""


class HostSession:
    """The SSH connection to one host and the helper (:mod:`dlrover_hpc.ssh.remote`) on it."""

    def __init__(
        self, entry: HostEntry, *, ssh: SshOptions, output: Output, remote_command: str
    ) -> None:
        self.entry = entry
        self.name = entry.name
        self.node = entry.name  # the host's own name, from its hello
        self.state = SessionState.NEW
        self.exit_code: int | None = None
        self._ssh = ssh
        self._output = output
        self._command = remote_command
        self._conn: asyncssh.SSHClientConnection | None = None
        self._proc: asyncssh.SSHClientProcess[str] | None = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._pumps: list[asyncio.Task[None]] = []
        self._watcher: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()

    # ------------------------------------------------------------------ start
    async def open(self) -> None:
        """Connect and start the helper; raises LaunchError naming the host on failure."""
        try:
            await self._open()
        except BaseException:
            self._conn_abort()
            self.state = SessionState.ENDED
            self._ended.set()
            raise

    async def _open(self) -> None:
        try:
            self._conn = await asyncssh.connect(self.name, **self._ssh.connect_kwargs())
        except (OSError, asyncssh.Error, TimeoutError, ValueError) as exc:
            raise LaunchError(connect_error(self.name, exc, self._ssh)) from None
        try:
            self._proc = await self._conn.create_process(self._command, errors="replace")
        except (OSError, asyncssh.Error) as exc:
            self._conn.abort()
            raise LaunchError(f"{self.name}: cannot start a command over SSH: {exc}") from None
        self._pumps.append(asyncio.create_task(self._pump(self._proc.stderr, stderr=True)))
        hello = await self._read_hello()
        self.node = str(hello["node"])
        self.state = SessionState.READY
        self._pumps.append(asyncio.create_task(self._pump(self._proc.stdout, stderr=False)))
        self._watcher = asyncio.create_task(self._watch())

    async def _read_hello(self) -> dict[str, Any]:
        assert self._proc is not None
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                while True:
                    line = await self._proc.stdout.readline()
                    if not line:
                        break
                    hello = remote.parse_hello(line.rstrip("\n"))
                    if hello is not None:
                        return hello
                    self._output.line(self.name, line.rstrip("\n"), stderr=False)
        except (TimeoutError, asyncssh.Error, OSError):
            pass
        await self._settle(5.0)
        code = self._proc.returncode
        tail = " | ".join(self._stderr_tail) or "no output"
        self._conn_abort()
        raise LaunchError(
            f"{self.name}: the remote helper did not start (exit {code}): {tail}; is "
            f"dlrover-hpc installed on {self.name} at the same path (the command was: "
            f"{self._command})?"
        )

    def start(self, spec: dict[str, Any]) -> None:
        """Send the start line: the agent's argv, environment (with the token) and cwd."""
        assert self._proc is not None and self.state is SessionState.READY
        try:
            self._proc.stdin.write(json.dumps(spec) + "\n")
        except (asyncssh.Error, OSError) as exc:  # the channel is gone; _watch records it
            log.warning("cannot start the agent host=%s error=%s", self.name, exc)
            return
        self.state = SessionState.RUNNING

    # -------------------------------------------------------------- running
    async def _pump(self, reader: asyncssh.SSHReader[str], *, stderr: bool) -> None:
        with contextlib.suppress(asyncssh.Error, OSError):
            while line := await reader.readline():
                text = line.rstrip("\n")
                if stderr:
                    self._stderr_tail.append(text)
                self._output.line(self.name, text, stderr=stderr)

    async def _watch(self) -> None:
        assert self._proc is not None
        with contextlib.suppress(asyncssh.Error, OSError):
            await asyncio.gather(*self._pumps, return_exceptions=True)
            await self._proc.wait_closed()
        code = self._proc.returncode
        self.exit_code = CONNECTION_LOST if code is None else remote.exit_code(code)
        ran, self.state = self.state is SessionState.RUNNING, SessionState.ENDED
        self._ended.set()
        log.log(
            logging.INFO if self.exit_code == 0 else logging.WARNING,
            "%s host=%s exit_code=%d%s",
            "agent ended" if ran else "released, no agent started",
            self.name,
            self.exit_code,
            describe_exit(self.exit_code),
        )

    async def _settle(self, timeout_s: float) -> None:
        assert self._proc is not None
        with contextlib.suppress(TimeoutError, asyncssh.Error, OSError):
            async with asyncio.timeout(timeout_s):
                await self._proc.wait_closed()

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    async def wait(self, timeout_s: float | None = None) -> bool:
        """True once the remote helper has exited (or the connection is gone)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._ended.wait()
        return self.ended

    def signal(self, name: str) -> None:
        """Forward a signal (``SIGINT``, ``SIGTERM``) to the agent."""
        if self._proc is not None and self.state is SessionState.RUNNING:
            with contextlib.suppress(asyncssh.Error, OSError, BrokenPipeError):
                self._proc.stdin.write(name + "\n")

    def stop(self) -> None:
        """End of input: the helper stops the agent (SIGTERM, then SIGKILL after its grace)."""
        if self._proc is not None and not self.ended:
            with contextlib.suppress(asyncssh.Error, OSError, BrokenPipeError):
                self._proc.stdin.write_eof()

    async def close(self, timeout_s: float = 5.0) -> None:
        """Close the connection (the helper sees the end of input and cleans up)."""
        if self._conn is None:
            return
        if timeout_s > 0:
            self._conn.close()
            with contextlib.suppress(TimeoutError, asyncssh.Error, OSError):
                async with asyncio.timeout(timeout_s):
                    await self._conn.wait_closed()
        self._conn_abort()
        for task in self._pumps:
            task.cancel()
        if not self.ended:
            self.exit_code = self.exit_code if self.exit_code is not None else CONNECTION_LOST
            self.state = SessionState.ENDED
            self._ended.set()

    def _conn_abort(self) -> None:
        if self._conn is not None:
            self._conn.abort()
