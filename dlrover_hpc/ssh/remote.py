"""The launcher's helper on each host: ``python -m dlrover_hpc.ssh.remote`` over SSH.

It keeps secrets off command lines and leaves nothing behind when the SSH channel goes away:

1. prints one hello line on stdout (``MARK {"node": ..., "pid": ...}``), so the launcher learns
   the host's own name (the name the master uses) before anything starts;
2. reads one JSON line from stdin: ``{"argv": [...], "env": {...}, "cwd": "...", "grace_s": N}``
   (the job token travels in ``env``, never on a command line); end of input instead means
   "do not start" and it exits 0;
3. runs ``argv`` (the ``dlrover-run`` agent) in its own session, stdout and stderr straight to
   the channel, as a child that gets SIGTERM if this helper dies;
4. afterwards each stdin line is a signal name (``SIGINT``, ``SIGTERM``) for the agent, and the
   end of stdin (the launcher closed the channel or the connection dropped) stops the agent:
   SIGTERM, then after ``grace_s`` SIGKILL to everything it started;
5. when the agent exits, kills whatever it left behind (it is the child subreaper, so even
   processes that started their own session are found) and exits with the agent's code.

Only the standard library and psutil: it must start fast on every host.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import psutil

MARK = "@dlrover-hpc-remote"
DEFAULT_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def hello_line(node: str, pid: int) -> str:
    return f"{MARK} {json.dumps({'node': node, 'pid': pid})}"


def parse_hello(line: str) -> dict[str, Any] | None:
    """The hello of :func:`hello_line`, or None when ``line`` is something else."""
    if not line.startswith(MARK + " "):
        return None
    try:
        info = json.loads(line[len(MARK) + 1 :])
    except ValueError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("node"), str) else None


def exit_code(returncode: int) -> int:
    """A shell's view of a child's return code: 128+N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


class Supervisor:
    """Runs the agent and acts on the launcher's control lines (see the module docstring)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self.argv = [str(a) for a in spec["argv"]]
        self.env = {**os.environ, **{str(k): str(v) for k, v in spec.get("env", {}).items()}}
        self.cwd = str(spec.get("cwd") or os.path.expanduser("~"))
        self.grace_s = float(spec.get("grace_s", DEFAULT_GRACE_S))
        self._stop = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def run(self) -> int:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        cwd = self.cwd if os.path.isdir(self.cwd) else None
        if cwd is None:
            print(
                f"dlrover-hpc remote: {self.cwd} does not exist on {socket.gethostname()}; "
                "running in the home directory",
                file=sys.stderr,
                flush=True,
            )
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # safe: no thread has started yet
            )
        except OSError as exc:
            print(f"dlrover-hpc remote: cannot run {self.argv[0]}: {exc}", file=sys.stderr)
            return 127
        threading.Thread(target=self._control, name="control", daemon=True).start()
        proc = self.proc
        while proc.poll() is None:
            if self._stop.wait(0.2):
                self._terminate(proc)
                break
        code = exit_code(proc.wait())
        self._kill_leftovers()
        return code

    def _control(self) -> None:
        """stdin: a signal name per line; end of input means the channel is gone."""
        assert self.proc is not None
        for raw in sys.stdin:
            name = raw.strip()
            if name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.Signals[name])
        self._stop.set()

    def _terminate(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            self._kill_tree()

    def _kill_leftovers(self) -> None:
        left = _descendants()
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=min(2.0, self.grace_s))
        if alive:
            self._kill_tree()

    def _kill_tree(self) -> None:
        for p in _descendants():
            with contextlib.suppress(psutil.Error):
                p.kill()
        _reap()


def _descendants() -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process().children(recursive=True)
    return []


def _reap() -> None:
    """Collect orphans that were re-parented to us (we are their subreaper)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if not _descendants():
                return
            time.sleep(0.05)


def main() -> int:
    node = socket.gethostname().split(".")[0]
    print(hello_line(node, os.getpid()), flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the launcher decided not to start anything here
    supervisor = Supervisor(json.loads(line))
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, supervisor.request_stop)  # the handler only sets a flag
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
