"""Run the network-check probe in a child process that is killed at a hard deadline.

The child is `python -m dlrover_hpc.netcheck.probe --json ...` (or the same module run by a
pre-warmed interpreter that has torch imported already: ``runner``); torch's own timeouts overshoot
and an NCCL collective can block for good, so only a separate process guarantees an answer in
time. The child leads its own session, and the kill takes everything it started.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from dlrover_hpc.netcheck.model import NetcheckError
from dlrover_hpc.netcheck.probe import (
    DEFAULT_PAYLOAD_BYTES,
    DEFAULT_PREFIX,
    Deadline,
    first_line,
    validate_args,
)
from dlrover_hpc.netcheck.result import ProbeResult

logger = logging.getLogger(__name__)

_STDERR_TAIL_CHARS = 600


def run_probe_subprocess(
    *,
    group_rank: int,
    group_size: int,
    store_host: str,
    store_port: int,
    timeout_s: float,
    is_store_host: bool,
    prefix: str = DEFAULT_PREFIX,
    payload_bytes: int = DEFAULT_PAYLOAD_BYTES,
    matmul_size: int | None = None,
    use_cuda: bool | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
    runner: Sequence[str] = (),
) -> ProbeResult:
    """Run the probe in a child process killed at `timeout_s`; always returns a result in time.

    The child gets a slightly shorter budget so that it normally reports its own reason (for
    example the partner that never joined) before the hard kill.  ``runner``: the command that
    runs a module with its arguments in place of ``python -m`` (the agent's zygote client: a
    fork of an interpreter that imported torch, not a second ``import torch`` on the node); the
    process it starts must mirror the module's output and exit code, and take the module's
    process along when it is killed.
    """
    validate_args(
        group_rank=group_rank,
        group_size=group_size,
        store_port=store_port,
        timeout_s=timeout_s,
        payload_bytes=payload_bytes,
    )
    deadline = Deadline(timeout_s)
    child_timeout_s = timeout_s - min(2.0, 0.25 * timeout_s)
    argv = [
        *(runner or (python, "-m")),
        "dlrover_hpc.netcheck.probe",
        "--json",
        f"--group-rank={group_rank}",
        f"--group-size={group_size}",
        f"--store-host={store_host}",
        f"--store-port={store_port}",
        f"--timeout-s={child_timeout_s:.3f}",
        # Its deadline counts from now, not from after its `import torch` (slow on a busy node).
        f"--not-after={time.time() + child_timeout_s:.3f}",
        f"--prefix={prefix}",
        f"--payload-bytes={payload_bytes}",
    ]
    if is_store_host:
        argv.append("--store-host-side")
    if matmul_size is not None:
        argv.append(f"--matmul-size={matmul_size}")
    if use_cuda is not None:
        argv.append("--cuda" if use_cuda else "--no-cuda")
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(env),
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(deadline.left_s(), 0.0))
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, err = _drain(proc)
        logger.warning("netcheck_probe_killed pid=%d timeout_s=%g", proc.pid, timeout_s)
        killed = f"did not finish within {timeout_s:g} s and was killed (pid {proc.pid})"
        reason = _reported_reason(err)
        return ProbeResult(
            ok=False,
            # the probe's own reason when it said one before the kill (on a loaded machine it
            # may fail in time and still not exit in time)
            error=f"{reason} (then the probe {killed})"
            if reason
            else f"probe {killed}{_stderr_note(err)}",
            elapsed_s=time.monotonic() - started,
        )
    return _parse_child(out, err, returncode=proc.returncode, elapsed_s=time.monotonic() - started)


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    merged = dict(os.environ if env is None else env)
    # The child must import this same package. An installed package is found anyway; a source
    # checkout that this process found through its own path is handed on explicitly.
    root = Path(__file__).resolve().parents[2]
    if "site-packages" not in root.parts and "dist-packages" not in root.parts:
        path = merged.get("PYTHONPATH", "")
        merged["PYTHONPATH"] = str(root) if not path else f"{root}{os.pathsep}{path}"
    return merged


def _kill_session(proc: subprocess.Popen[str]) -> None:
    """Kill the child and anything it started: it leads its own session (start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:
        proc.kill()


def _drain(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=5.0)
    except subprocess.TimeoutExpired:
        return "", ""


def _parse_child(out: str, err: str, *, returncode: int, elapsed_s: float) -> ProbeResult:
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if line is None:
        return ProbeResult(
            ok=False,
            error=f"probe exited with code {returncode} without a result{_stderr_note(err)}",
            elapsed_s=elapsed_s,
        )
    try:
        return ProbeResult.from_json(line)
    except (NetcheckError, TypeError) as e:
        return ProbeResult(ok=False, error=f"unreadable probe result: {e}", elapsed_s=elapsed_s)


def _reported_reason(err: str) -> str:
    """The reason a probe logged for its failure (``netcheck_probe_failed ... reason=``)."""
    for line in reversed(err.splitlines()):
        if "netcheck_probe_failed" in line and " reason=" in line:
            return line.split(" reason=", 1)[1].strip()
    return ""


def _stderr_note(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return f"; stderr: {first_line(lines[-1])[-_STDERR_TAIL_CHARS:]}"
