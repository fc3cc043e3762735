"""The node's worker processes as one context: start them, poll them, stop them.

torchrun's behaviour, without torch: each worker runs in a session of its own, its streams go to
the console or to ``<log dir>/<run id>_<random>/attempt_<restart>/<local rank>/{stdout,stderr}.log``
(``--redirects``), a redirected stream can still be copied to the console with a ``[rankN]:``
prefix (``--tee``), and each worker is told where to write its ``error.json``
(``TORCHELASTIC_ERROR_FILE``, written by ``torch.distributed.elastic``'s ``@record``).  When one
worker fails, the others are stopped: SIGTERM to their process groups, SIGKILL after the grace.

The agent used torch.distributed.elastic's process API for this; importing it imports torch,
which cost every agent start about 2.5 s of CPU and 200 MB of memory, on each node and at every
agent relaunch, for bookkeeping that needs none of torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TextIO

log = logging.getLogger(__name__)

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
TEE_POLL_S = 0.1
NO_ERROR_FILE = ""  # ProcFailure.error_file of a worker that wrote none


class Streams(enum.IntFlag):
    """Which of a worker's streams a ``--redirects`` or ``--tee`` value names."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def parse_streams(value: str, nproc: int) -> dict[int, Streams]:
    """``"3"`` for every local rank, or ``"0:1,1:2"`` per local rank (the rest: none); the
    value was checked with the flags (``config._check_std_streams``)."""
    if ":" not in value:
        return dict.fromkeys(range(nproc), Streams(int(value)))
    given = {int(k): Streams(int(v)) for k, v in (part.split(":") for part in value.split(","))}
    return {lr: given.get(lr, Streams.NONE) for lr in range(nproc)}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogSpec:
    """Where the workers' streams go: ``log_dir`` None is a fresh temporary directory."""

    log_dir: str | None
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: frozenset[int] | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcFailure:
    """A worker that exited non-zero; ``error_file`` is "" when it wrote none, ``timestamp`` is
    the error file's, else when the exit was seen."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: str
    timestamp: float

    def signal_name(self) -> str:
        return signal_name(self.exitcode)


def signal_name(exitcode: int) -> str:
    """``SIGKILL`` for a process's exit code -9."""
    if exitcode >= 0:
        return "<N/A>"
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProcsResult:
    """All workers ended (``failures`` empty), or some failed and the rest were stopped."""

    failures: Mapping[int, ProcFailure]

    def is_failed(self) -> bool:
        return bool(self.failures)


def _failure(local_rank: int, pid: int, exitcode: int, error_file: str) -> ProcFailure:
    message, timestamp = "", time.time()
    if os.path.isfile(error_file):
        try:
            with open(error_file, encoding="utf-8") as fh:
                data = json.load(fh)
            body = data.get("message", "")
            if isinstance(body, dict):
                message = str(body.get("message", ""))
                timestamp = float(body.get("extraInfo", {}).get("timestamp", timestamp))
            else:
                message = str(body)
                timestamp = float(data.get("timestamp", timestamp))
        except (OSError, ValueError, AttributeError, TypeError) as e:
            message = f"unreadable error file {error_file}: {e}"
    else:
        error_file = NO_ERROR_FILE
    if not message:
        if exitcode < 0:
            message = f"Signal {-exitcode} ({signal_name(exitcode)}) received by PID {pid}"
        else:
            message = f"exit code {exitcode}; no error file (decorate main with @record for one)"
    return ProcFailure(
        local_rank=local_rank,
        pid=pid,
        exitcode=exitcode,
        error_file=error_file,
        message=message,
        timestamp=timestamp,
    )


class _Tee:
    """Copies lines appended to log files to the console, each with its rank's prefix."""

    def __init__(self, sources: Sequence[tuple[str, TextIO, str]]) -> None:
        self._sources = sources
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-log-tee", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        files: dict[str, IO[str]] = {}
        partial: dict[str, str] = {}
        try:
            while True:
                finishing = self._done.is_set()
                for path, dst, prefix in self._sources:
                    fh = files.get(path)
                    if fh is None:
                        try:
                            fh = files[path] = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115 - closed in finally
                        except FileNotFoundError:
                            continue
                    text = partial.pop(path, "") + fh.read()
                    lines = text.split("\n")
                    partial[path] = lines.pop()  # "" after a complete last line
                    if finishing and partial[path]:
                        lines.append(partial.pop(path))
                    if lines:
                        with contextlib.suppress(OSError, ValueError):
                            dst.write("".join(f"{prefix}{line}\n" for line in lines))
                            dst.flush()
                if finishing:
                    return
                self._done.wait(TEE_POLL_S)
        finally:
            for fh in files.values():
                fh.close()

    def stop(self) -> None:
        """Copy what is left, then end."""
        self._done.set()
        self._thread.join(timeout=5)


class WorkerProcs:
    """One round's workers on this node: ``args[lr]`` run with ``envs[lr]`` added to ours."""

    def __init__(
        self,
        *,
        args: Mapping[int, Sequence[str]],
        envs: Mapping[int, Mapping[str, str]],
        logs: LogSpec,
        prefixes: Mapping[int, str],
        grace_s: float = 30.0,
    ) -> None:
        nproc = len(args)
        self._grace_s = grace_s
        redirects = parse_streams(logs.redirects, nproc)
        tee = parse_streams(logs.tee, nproc)
        attempt_dir = _attempt_dir(logs.log_dir, envs[0] if envs else {})
        self.stdouts: dict[int, str] = {}
        self.stderrs: dict[int, str] = {}
        self.error_files: dict[int, str] = {}
        self._files: list[IO[bytes]] = []
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._failures: dict[int, ProcFailure] = {}
        self._running = set(range(nproc))
        self._ended: set[int] = set()  # ended by end(): their exit is a success
        tee_sources: list[tuple[str, TextIO, str]] = []
        filtered = logs.local_ranks_filter
        try:
            for lr in range(nproc):
                rank_dir = os.path.join(attempt_dir, str(lr))
                os.makedirs(rank_dir, exist_ok=True)
                shown = filtered is None or lr in filtered
                into = redirects[lr] | tee[lr]  # a tee'd stream is written to its file first
                streams: dict[str, int | IO[bytes] | None] = {}
                for flag, name, console, paths in (
                    (Streams.OUT, "stdout", sys.stdout, self.stdouts),
                    (Streams.ERR, "stderr", sys.stderr, self.stderrs),
                ):
                    if into & flag:
                        path = paths[lr] = os.path.join(rank_dir, f"{name}.log")
                        fh = open(path, "wb")  # noqa: SIM115 - closed in close()
                        self._files.append(fh)
                        streams[name] = fh
                        if tee[lr] & flag and shown:
                            tee_sources.append((path, console, prefixes.get(lr, "")))
                    else:
                        streams[name] = None if shown else subprocess.DEVNULL
                error_file = self.error_files[lr] = os.path.join(rank_dir, "error.json")
                self._procs[lr] = subprocess.Popen(
                    list(args[lr]),
                    env={**os.environ, **envs[lr], ERROR_FILE_ENV: error_file},
                    stdout=streams["stdout"],
                    stderr=streams["stderr"],
                    start_new_session=True,  # its process group is signalled as one
                )
        except BaseException:
            self._signal_all(signal.SIGKILL)
            self._close_files()
            raise
        self._tee = _Tee(tee_sources) if tee_sources else None

    def pids(self) -> dict[int, int]:
        return {lr: p.pid for lr, p in self._procs.items()}

    def poll(self) -> ProcsResult | None:
        """None while all run (or some ended well and the rest still run); otherwise the
        result, with every worker ended: when one failed, the others are stopped first."""
        self._capture()
        if self._running and not self._failures:
            return None
        self.close(timeout_s=self._grace_s)
        self._capture()
        return ProcsResult(failures=dict(self._failures))

    def end(self, local_ranks: Sequence[int]) -> None:
        """SIGKILL these workers and count them as succeeded: they finished training and
        hang at exit (the master's :class:`EndWorkers`)."""
        for lr in local_ranks:
            proc = self._procs.get(lr)
            if proc is not None and lr in self._running:
                self._ended.add(lr)
                log.warning("ending worker hung at exit local_rank=%d pid=%d", lr, proc.pid)
                _killpg(proc, signal.SIGKILL)

    def _capture(self) -> None:
        for lr in sorted(self._running):
            proc = self._procs[lr]
            code = proc.poll()
            if code is None:
                continue
            self._running.discard(lr)
            if code != 0 and lr not in self._ended:
                self._failures[lr] = _failure(lr, proc.pid, code, self.error_files[lr])

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout_s: float = 30) -> None:
        """Stop the workers still running (``death_sig``, SIGKILL after ``timeout_s``)."""
        alive = [p for p in self._procs.values() if p.poll() is None]
        for proc in alive:
            log.warning("stopping worker pid=%d with %s", proc.pid, death_sig.name)
            _killpg(proc, death_sig)
        end = time.monotonic() + timeout_s
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, end - time.monotonic()))
        for proc in alive:
            if proc.poll() is None:
                log.warning("worker pid=%d outlived %s: SIGKILL", proc.pid, death_sig.name)
                _killpg(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    log.error("worker pid=%d survives SIGKILL (uninterruptible sleep?)", proc.pid)
        if self._tee is not None:
            self._tee.stop()
            self._tee = None
        self._close_files()

    def _signal_all(self, sig: signal.Signals) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                _killpg(proc, sig)
                proc.wait()

    def _close_files(self) -> None:
        for fh in self._files:
            fh.close()
        self._files.clear()


def _killpg(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _attempt_dir(log_dir: str | None, env: Mapping[str, str]) -> str:
    """torchrun's layout: ``<log_dir>/<run id>_<random>/attempt_<restart count>``."""
    base = log_dir or tempfile.mkdtemp(prefix="dlrover-hpc-logs-")
    if os.path.isfile(base):
        raise NotADirectoryError(f"--log-dir={base} is a file")
    os.makedirs(base, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix=f"{env.get('TORCHELASTIC_RUN_ID', 'run')}_", dir=base)
    attempt = os.path.join(run_dir, f"attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    os.makedirs(attempt)
    return attempt
