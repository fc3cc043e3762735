"""The network-check probe that runs on a node, one process per node and group.

`run_probe` times a matmul on the node's accelerator (CPU when there is no CUDA), then joins its
group through a `torch.distributed.TCPStore` that group rank 0 hosts, and times an all-reduce of a
few MiB over gloo (TCP). With CUDA available it also times an NCCL all-reduce, since a TCP check
proves reachability, not the GPU fabric.

Every wait has a deadline, but torch's own timeouts overshoot (a TCPStore client retries once
more after its timeout) and an NCCL collective can block for good. So the supported entry point is
`run_probe_subprocess`, which runs `python -m dlrover_hpc.netcheck.probe --json ...` in a child
process and kills it at the hard deadline: it always returns a `ProbeResult` in time.

`run_probe` initialises torch's default process group, so it must run in a process that has none
(the child process does).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlrover_hpc.netcheck.analysis import NetcheckError

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "dlrover-hpc/netcheck"
DEFAULT_PAYLOAD_BYTES = 4 * 1024 * 1024
CPU_MATMUL_SIZE = 512
CUDA_MATMUL_SIZE = 4096
MATMUL_ITERS = 3
COLLECTIVE_ITERS = 3
# Share of the remaining time given to the store connection: a TCPStore client may take about
# twice its timeout (one retry after the timeout), and the collectives still need time after it.
CONNECT_SHARE = 0.4
_STDERR_TAIL_CHARS = 600


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """Outcome of one probe on one node. Times are seconds; None where the step did not run."""

    ok: bool
    matmul_s: float | None = None
    collective_s: float | None = None
    nccl_s: float | None = None
    device: str = "cpu"
    error: str = ""
    elapsed_s: float = 0.0

    @property
    def check_s(self) -> float | None:
        """The node's check time for the analysis: matmul plus collectives; None if it failed."""
        if not self.ok or self.matmul_s is None or self.collective_s is None:
            return None
        return self.matmul_s + self.collective_s + (self.nccl_s or 0.0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise NetcheckError(f"probe output is not JSON ({e}): {text[:200]!r}") from e
        if not isinstance(data, dict):
            raise NetcheckError(f"probe output is not a JSON object: {text[:200]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown or "ok" not in data:
            raise NetcheckError(
                f"probe output has unknown keys {sorted(unknown)!r} or lacks 'ok': {text[:200]!r}"
            )
        return cls(**data)


class _Deadline:
    def __init__(self, timeout_s: float) -> None:
        self._end = time.monotonic() + timeout_s

    def left_s(self) -> float:
        return self._end - time.monotonic()


def run_probe(
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
) -> ProbeResult:
    """Run the probe in this process; failures come back as `ok=False` with the reason.

    Raises `NetcheckError` only for invalid arguments.
    """
    _validate(
        group_rank=group_rank,
        group_size=group_size,
        store_port=store_port,
        timeout_s=timeout_s,
        payload_bytes=payload_bytes,
    )
    started = time.monotonic()
    deadline = _Deadline(timeout_s)
    import torch  # deferred: importing torch costs about a second
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    device = "cuda" if cuda else "cpu"
    size = matmul_size or (CUDA_MATMUL_SIZE if cuda else CPU_MATMUL_SIZE)
    step = "matmul"
    timings: dict[str, float] = {}
    try:
        timings["matmul_s"] = _time_matmul(torch, device=device, size=size)
        step = "store"
        if dist.is_initialized():
            raise NetcheckError("a default process group already exists in this process")
        store = _connect_store(
            dist,
            host=store_host,
            port=store_port,
            world_size=group_size,
            is_host=is_store_host,
            timeout_s=_share(deadline, CONNECT_SHARE),
        )
        group_store = dist.PrefixStore(f"{prefix}/", store)
        step = "process_group"
        dist.init_process_group(
            backend="cpu:gloo,cuda:nccl" if cuda else "gloo",
            store=group_store,
            rank=group_rank,
            world_size=group_size,
            timeout=datetime.timedelta(seconds=_share(deadline, 1.0)),
        )
        try:
            step = "gloo_all_reduce"
            timings["collective_s"] = _time_all_reduce(
                torch, dist, device="cpu", payload_bytes=payload_bytes, group_size=group_size
            )
            if cuda:
                step = "nccl_all_reduce"
                timings["nccl_s"] = _time_all_reduce(
                    torch, dist, device="cuda", payload_bytes=payload_bytes, group_size=group_size
                )
            step = "finish"
            _finish(group_store, group_size=group_size, is_host=is_store_host, deadline=deadline)
        finally:
            dist.destroy_process_group()
    except Exception as e:  # the probe's boundary: every failure becomes a result
        reason = f"{step}: {type(e).__name__}: {_first_line(str(e))}"
        logger.warning(
            "netcheck_probe_failed rank=%d store=%s:%d reason=%s",
            group_rank,
            store_host,
            store_port,
            reason,
        )
        return ProbeResult(
            ok=False,
            device=device,
            error=reason,
            elapsed_s=time.monotonic() - started,
            matmul_s=timings.get("matmul_s"),
            collective_s=timings.get("collective_s"),
            nccl_s=timings.get("nccl_s"),
        )
    return ProbeResult(
        ok=True,
        device=device,
        elapsed_s=time.monotonic() - started,
        matmul_s=timings["matmul_s"],
        collective_s=timings["collective_s"],
        nccl_s=timings.get("nccl_s"),
    )


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
) -> ProbeResult:
    """Run the probe in a child process killed at `timeout_s`; always returns a result in time.

    The child gets a slightly shorter budget so that it normally reports its own reason (for
    example the partner that never joined) before the hard kill.
    """
    _validate(
        group_rank=group_rank,
        group_size=group_size,
        store_port=store_port,
        timeout_s=timeout_s,
        payload_bytes=payload_bytes,
    )
    deadline = _Deadline(timeout_s)
    child_timeout_s = timeout_s - min(2.0, 0.25 * timeout_s)
    argv = [
        python,
        "-m",
        "dlrover_hpc.netcheck.probe",
        "--json",
        f"--group-rank={group_rank}",
        f"--group-size={group_size}",
        f"--store-host={store_host}",
        f"--store-port={store_port}",
        f"--timeout-s={child_timeout_s:.3f}",
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
        return ProbeResult(
            ok=False,
            error=(
                f"probe did not finish within {timeout_s:g} s and was killed (pid {proc.pid})"
                f"{_stderr_note(err)}"
            ),
            elapsed_s=time.monotonic() - started,
        )
    return _parse_child(out, err, returncode=proc.returncode, elapsed_s=time.monotonic() - started)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m dlrover_hpc.netcheck.probe`: run one probe, print the result, exit 0 if ok."""
    parser = argparse.ArgumentParser(
        prog="python -m dlrover_hpc.netcheck.probe",
        description="Run one network-check probe with the other members of its group.",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--group-rank", type=int, required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--store-host", required=True, help="address of group rank 0's store")
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    parser.add_argument("--store-host-side", action="store_true", help="host the TCPStore here")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="store key prefix of this probe")
    parser.add_argument("--payload-bytes", type=int, default=DEFAULT_PAYLOAD_BYTES)
    parser.add_argument("--matmul-size", type=int, default=None)
    cuda = parser.add_mutually_exclusive_group()
    cuda.add_argument("--cuda", dest="use_cuda", action="store_true", default=None)
    cuda.add_argument("--no-cuda", dest="use_cuda", action="store_false")
    args = parser.parse_args(argv)
    try:
        result = run_probe(
            group_rank=args.group_rank,
            group_size=args.group_size,
            store_host=args.store_host,
            store_port=args.store_port,
            timeout_s=args.timeout_s,
            is_store_host=args.store_host_side,
            prefix=args.prefix,
            payload_bytes=args.payload_bytes,
            matmul_size=args.matmul_size,
            use_cuda=args.use_cuda,
        )
    except NetcheckError as e:
        parser.error(str(e))
    if args.json:
        print(result.to_json(), flush=True)
    else:
        print(_human(result), flush=True)
    return 0 if result.ok else 1


def _validate(
    *, group_rank: int, group_size: int, store_port: int, timeout_s: float, payload_bytes: int
) -> None:
    if group_size < 2:
        raise NetcheckError(f"group_size={group_size}; a probe group needs at least 2 members")
    if not 0 <= group_rank < group_size:
        raise NetcheckError(f"group_rank={group_rank}; expected 0 <= rank < {group_size}")
    if not 0 < store_port < 65536:
        raise NetcheckError(f"store_port={store_port}; expected a TCP port in 1..65535")
    if not timeout_s > 0:
        raise NetcheckError(f"timeout_s={timeout_s}; expected a positive number of seconds")
    if payload_bytes < 4:
        raise NetcheckError(f"payload_bytes={payload_bytes}; expected at least 4 (one float32)")


def _share(deadline: _Deadline, share: float) -> float:
    left = deadline.left_s()
    if left <= 0:
        raise TimeoutError("the probe's time ran out")
    return max(left * share, 0.05)


def _time_matmul(torch: Any, *, device: str, size: int) -> float:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: kernels, allocator
    _sync(torch, device)
    start = time.perf_counter()
    for _ in range(MATMUL_ITERS):
        torch.matmul(a, b)
    _sync(torch, device)
    return (time.perf_counter() - start) / MATMUL_ITERS


def _time_all_reduce(
    torch: Any, dist: Any, *, device: str, payload_bytes: int, group_size: int
) -> float:
    tensor = torch.ones(max(payload_bytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up, and a barrier: the timing excludes waiting for partners
    _sync(torch, device)
    start = time.perf_counter()
    for _ in range(COLLECTIVE_ITERS):
        tensor.fill_(1.0)
        dist.all_reduce(tensor)
    _sync(torch, device)
    elapsed = (time.perf_counter() - start) / COLLECTIVE_ITERS
    got = float(tensor[0].item()), float(tensor[-1].item())
    if got != (float(group_size), float(group_size)):
        raise NetcheckError(f"all-reduce on {device} returned {got}, expected {group_size}")
    return elapsed


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _connect_store(
    dist: Any, *, host: str, port: int, world_size: int, is_host: bool, timeout_s: float
) -> Any:
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_host,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=True,
    )


def _finish(store: Any, *, group_size: int, is_host: bool, deadline: _Deadline) -> None:
    """Keep the store host alive until every member is done with the store."""
    store.add("finished", 1)
    if not is_host:
        return
    while store.add("finished", 0) < group_size:
        if deadline.left_s() <= 0:
            raise TimeoutError("not every member reported the end of the probe")
        time.sleep(0.01)


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


def _stderr_note(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    return f"; stderr: {_first_line(lines[-1])[-_STDERR_TAIL_CHARS:]}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _human(result: ProbeResult) -> str:
    if not result.ok:
        return f"probe failed after {result.elapsed_s:.2f} s: {result.error}"
    parts = [f"matmul {result.matmul_s:.4f} s", f"gloo all-reduce {result.collective_s:.4f} s"]
    if result.nccl_s is not None:
        parts.append(f"nccl all-reduce {result.nccl_s:.4f} s")
    return f"probe ok on {result.device}: " + ", ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
