"""The network-check probe that runs on a node, one process per node and group.

`run_probe` times a matmul on the node's accelerator (CPU when there is no CUDA), then joins its
group through a `torch.distributed.TCPStore` that group rank 0 hosts, and times an all-reduce of a
few MiB over gloo (TCP). With CUDA available it also times an NCCL all-reduce, since a TCP check
proves reachability, not the GPU fabric, and first checks the node's own GPU links
(`netcheck.gpu_links`: each GPU pair and host <-> GPU; a slow link fails the probe).

Every wait has a deadline, but torch's own timeouts overshoot (a TCPStore client retries once
more after its timeout) and an NCCL collective can block for good. So the supported entry point is
`netcheck.launch.run_probe_subprocess`, which runs `python -m dlrover_hpc.netcheck.probe --json
...` (this module's `main`) in a child process and kills it at the hard deadline: it always
returns a `ProbeResult` in time.

`run_probe` initialises torch's default process group, so it must run in a process that has none
(the child process does).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import socket
import time
from collections.abc import Sequence
from typing import Any

from dlrover_hpc.netcheck import gpu_links
from dlrover_hpc.netcheck.model import NetcheckError
from dlrover_hpc.netcheck.result import ProbeResult

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "dlrover-hpc/netcheck"
DEFAULT_PAYLOAD_BYTES = 4 * 1024 * 1024
CPU_MATMUL_SIZE = 512
CUDA_MATMUL_SIZE = 4096
# Each timing is the best of several runs: a busy host's scheduler only ever adds time, while a
# slow device or link is slow every time. A mean over the runs made one preempted run on a loaded
# machine look like a straggler (more than twice the median), which cost the check a second round.
MATMUL_ITERS = 5
COLLECTIVE_ITERS = 5
# Share of the remaining time given to the store connection: a TCPStore client may take about
# twice its timeout (one retry after the timeout), and the collectives still need time after it.
CONNECT_SHARE = 0.4
LISTEN_POLL_S = 0.1  # a client's retry interval while the store host is not listening yet


class Deadline:
    """A point in time that the remaining budget is measured against."""

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
    validate_args(
        group_rank=group_rank,
        group_size=group_size,
        store_port=store_port,
        timeout_s=timeout_s,
        payload_bytes=payload_bytes,
    )
    started = time.monotonic()
    deadline = Deadline(timeout_s)
    import torch  # deferred: importing torch costs about a second
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if use_cuda is None else use_cuda
    device = "cuda" if cuda else "cpu"
    size = matmul_size or (CUDA_MATMUL_SIZE if cuda else CPU_MATMUL_SIZE)
    step = "matmul"
    timings: dict[str, float] = {}
    links: tuple[tuple[str, str, float], ...] = ()
    try:
        timings["matmul_s"] = _time_matmul(torch, device=device, size=size)
        if cuda:  # skipped without GPUs: there are no GPU links to check
            step = "gpu_links"
            measured = gpu_links.measure_links(torch)
            links = tuple((link.src, link.dst, link.gbps) for link in measured)
            slow = gpu_links.slow_links(measured)
            if slow:
                raise NetcheckError(gpu_links.describe_slow(slow))
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
        reason = f"{step}: {type(e).__name__}: {first_line(str(e))}"
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
            gpu_links=links,
        )
    return ProbeResult(
        ok=True,
        device=device,
        elapsed_s=time.monotonic() - started,
        matmul_s=timings["matmul_s"],
        collective_s=timings["collective_s"],
        nccl_s=timings.get("nccl_s"),
        gpu_links=links,
    )


def _budget(timeout_s: float, not_after: float | None) -> float:
    """The probe's time: ``timeout_s``, cut to what is left before ``not_after`` (the parent
    counts from its own start); a short minimum still lets it report why it failed."""
    if not_after is None:
        return timeout_s
    return max(0.3, min(timeout_s, not_after - time.time()))


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
    parser.add_argument(
        "--not-after", type=float, default=None, help="Unix time by which to report, at the latest"
    )
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
            timeout_s=_budget(args.timeout_s, args.not_after),
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


def validate_args(
    *, group_rank: int, group_size: int, store_port: int, timeout_s: float, payload_bytes: int
) -> None:
    """Raise `NetcheckError` naming the first argument of a probe that is out of range."""
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


def _share(deadline: Deadline, share: float) -> float:
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
    best = math.inf
    for _ in range(MATMUL_ITERS):
        start = time.perf_counter()
        torch.matmul(a, b)
        _sync(torch, device)
        best = min(best, time.perf_counter() - start)
    return best


def _time_all_reduce(
    torch: Any, dist: Any, *, device: str, payload_bytes: int, group_size: int
) -> float:
    tensor = torch.ones(max(payload_bytes // 4, 1), dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up, and a barrier: the timing excludes waiting for partners
    _sync(torch, device)
    best = math.inf
    for _ in range(COLLECTIVE_ITERS):
        tensor.fill_(1.0)
        start = time.perf_counter()
        dist.all_reduce(tensor)
        _sync(torch, device)
        best = min(best, time.perf_counter() - start)
    got = float(tensor[0].item()), float(tensor[-1].item())
    if got != (float(group_size), float(group_size)):
        raise NetcheckError(f"all-reduce on {device} returned {got}, expected {group_size}")
    return best


def _sync(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _connect_store(
    dist: Any, *, host: str, port: int, world_size: int, is_host: bool, timeout_s: float
) -> Any:
    if not is_host:
        started = time.monotonic()
        _await_listener(host, port, timeout_s)
        timeout_s = max(timeout_s - (time.monotonic() - started), 0.05)
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_host,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=True,
    )


def _await_listener(host: str, port: int, timeout_s: float) -> None:
    """A client's wait, to its deadline, for the store host to listen.

    TCPStore's own client retries past its timeout (2.3 times it here: a 4 s timeout failed
    after 9 s) and prints a C++ stack per try, so on a loaded machine the probe was killed before
    it could say why (cc22). A plain connect loop keeps the deadline; TCPStore then connects at
    once.
    """
    end = time.monotonic() + timeout_s
    while True:
        left = end - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=min(max(left, 0.05), 1.0)):
                return
        except OSError as e:
            if time.monotonic() + LISTEN_POLL_S >= end:
                why = e.strerror or type(e).__name__
                raise NetcheckError(
                    f"no store host listens at {host}:{port} after {timeout_s:.1f} s ({why})"
                ) from None
            time.sleep(LISTEN_POLL_S)


def _finish(store: Any, *, group_size: int, is_host: bool, deadline: Deadline) -> None:
    """Keep the store host alive until every member is done with the store."""
    store.add("finished", 1)
    if not is_host:
        return
    while store.add("finished", 0) < group_size:
        if deadline.left_s() <= 0:
            raise TimeoutError("not every member reported the end of the probe")
        time.sleep(0.01)


def first_line(text: str) -> str:
    """The first line of ``text``, stripped (``text`` itself when it is blank)."""
    return text.strip().splitlines()[0] if text.strip() else text


def _human(result: ProbeResult) -> str:
    if not result.ok:
        return f"probe failed after {result.elapsed_s:.2f} s: {result.error}"
    parts = [f"matmul {result.matmul_s:.4f} s", f"gloo all-reduce {result.collective_s:.4f} s"]
    if result.nccl_s is not None:
        parts.append(f"nccl all-reduce {result.nccl_s:.4f} s")
    if result.gpu_links:
        slowest = min(result.gpu_links, key=lambda row: row[2])
        parts.append(
            f"{len(result.gpu_links)} GPU links, slowest {slowest[0]}->{slowest[1]}"
            f" {slowest[2]:.1f} GB/s"
        )
    return f"probe ok on {result.device}: " + ", ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
