"""The GPU link check inside one node (DLRover's switchbox / NVLink check): bandwidth of every
GPU pair, and of the host to and from each GPU.

`measure_links` copies a buffer over each ordered GPU pair (NVLink or NVSwitch where the GPUs
have it, else PCIe through the host: torch uses peer copies where the driver allows) and over
host <-> GPU (pinned memory), and keeps each link's best of several copies, in GB/s.
`slow_links` is the pure verdict: a link under `SLOW_SHARE` of the median of its kind (GPU-GPU,
host-GPU, GPU-host) is slow; an NVLink that fell back to PCIe is ~10x slower, far under it.

The network-check probe runs it on a node with CUDA (`probe.run_probe`); a slow link fails the
node's probe with the link and its figures, so the master treats the node as faulty. Without
CUDA there are no links to check and the check is skipped. On one GPU only the host links are
measured. `python -m dlrover_hpc.netcheck.gpu_links` prints one JSON line of the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_PAYLOAD_BYTES = 64 * 1024 * 1024  # a few ms per copy even on NVLink: timing is stable
ITERS = 5
#: a link slower than this share of the median link of its kind is slow
SLOW_SHARE = 0.25
HOST = "host"


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One measured direction: `src` to `dst` ("host" or "cuda:N"), best of the copies."""

    src: str
    dst: str
    gbps: float  # 1e9 bytes per second

    @property
    def kind(self) -> str:
        """ "gpu-gpu", "host-gpu" or "gpu-host": links are only compared within a kind."""
        if self.src == HOST:
            return "host-gpu"
        return "gpu-host" if self.dst == HOST else "gpu-gpu"

    def as_row(self) -> list[Any]:
        return [self.src, self.dst, round(self.gbps, 3)]


def links_from_rows(rows: Sequence[Sequence[Any]]) -> tuple[Link, ...]:
    """`Link`s from the `[src, dst, gbps]` rows of a probe's JSON line."""
    return tuple(Link(src=str(r[0]), dst=str(r[1]), gbps=float(r[2])) for r in rows)


def slow_links(links: Sequence[Link], *, share: float = SLOW_SHARE) -> list[tuple[Link, float]]:
    """(link, the median of its kind) for each link under ``share`` of that median.

    A kind needs at least three links for a median to stand for "normal" (with two, the slow
    one would pull it down half way); with fewer, a link is judged against the others of its
    kind only when there is one to compare to, at the same share of the faster one.
    """
    by_kind: dict[str, list[Link]] = {}
    for link in links:
        by_kind.setdefault(link.kind, []).append(link)
    out: list[tuple[Link, float]] = []
    for group in by_kind.values():
        if len(group) < 2:
            continue
        speeds = [link.gbps for link in group]
        normal = statistics.median(speeds) if len(group) >= 3 else max(speeds)
        out.extend((link, normal) for link in group if link.gbps < share * normal)
    return out


def describe_slow(slow: Sequence[tuple[Link, float]]) -> str:
    """One line naming each slow link and the median it was held against."""
    parts = [
        f"{link.src}->{link.dst} at {link.gbps:.1f} GB/s is under {SLOW_SHARE:.0%} of the"
        f" median {link.kind} link ({normal:.1f} GB/s)"
        for link, normal in slow
    ]
    return "; ".join(parts) + "; check the GPU links (nvidia-smi topo -m, nvidia-smi nvlink -s)"


def measure_links(
    torch: Any, *, payload_bytes: int = DEFAULT_PAYLOAD_BYTES, iters: int = ITERS
) -> tuple[Link, ...]:
    """Every host<->GPU and GPU->GPU link of this node; () without CUDA (the check skipped)."""
    if not torch.cuda.is_available():
        return ()
    count = torch.cuda.device_count()
    links: list[Link] = []
    host = torch.empty(payload_bytes, dtype=torch.uint8, pin_memory=True)
    buffers = [
        torch.empty(payload_bytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(count)
    ]
    for i, buf in enumerate(buffers):
        name = f"cuda:{i}"
        links.append(Link(src=HOST, dst=name, gbps=_copy_gbps(torch, buf, host, [i], iters)))
        links.append(Link(src=name, dst=HOST, gbps=_copy_gbps(torch, host, buf, [i], iters)))
    for i in range(count):
        for j in range(count):
            if i != j:
                gbps = _copy_gbps(torch, buffers[j], buffers[i], [i, j], iters)
                links.append(Link(src=f"cuda:{i}", dst=f"cuda:{j}", gbps=gbps))
    return tuple(links)


def _copy_gbps(torch: Any, dst: Any, src: Any, devices: Sequence[int], iters: int) -> float:
    def sync() -> None:
        for d in devices:
            torch.cuda.synchronize(d)

    dst.copy_(src, non_blocking=True)  # warm-up: peer mappings, the copy engines
    sync()
    best = math.inf
    for _ in range(iters):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - start)
    return src.numel() * src.element_size() / best / 1e9


def main(argv: Sequence[str] | None = None) -> int:
    """Measure this node's links; print one JSON line; exit 0 when none is slow (or none is
    there to check: the line says ``skipped``), 1 when one is."""
    parser = argparse.ArgumentParser(
        prog="python -m dlrover_hpc.netcheck.gpu_links",
        description="Bandwidth of each GPU pair of this node and of the host to each GPU.",
    )
    parser.add_argument("--payload-mib", type=int, default=DEFAULT_PAYLOAD_BYTES >> 20)
    parser.add_argument("--iters", type=int, default=ITERS)
    args = parser.parse_args(argv)
    import torch  # deferred: a second to import

    started = time.perf_counter()
    links = measure_links(torch, payload_bytes=args.payload_mib << 20, iters=args.iters)
    slow = slow_links(links)
    line: dict[str, Any] = {
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "payload_mib": args.payload_mib,
        "links": [link.as_row() for link in links],
        "slow": [link.as_row() for link, _ in slow],
        "seconds": round(time.perf_counter() - started, 3),
    }
    if not links:
        line["skipped"] = "no CUDA device: no GPU links to check"
    else:
        for kind in ("host-gpu", "gpu-host", "gpu-gpu"):
            speeds = [link.gbps for link in links if link.kind == kind]
            if speeds:
                line[f"{kind}_gbps"] = {"min": round(min(speeds), 3), "max": round(max(speeds), 3)}
    print(json.dumps(line, sort_keys=True), flush=True)
    return 1 if slow else 0


if __name__ == "__main__":
    raise SystemExit(main())
