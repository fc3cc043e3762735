"""Benchmark: the GPU link check of one node (`dlrover_hpc.netcheck.gpu_links`), needs CUDA.

Measures every host<->GPU and GPU->GPU link (best of 5 copies of --payload-mib) and, as the
same run's baseline, a copy inside cuda:0 (device memory bandwidth: no link is faster). Prints
one JSON line; without CUDA the line says skipped. Run: `python benchmarks/gpu_links.py`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dlrover_hpc.netcheck.gpu_links import measure_links, slow_links


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--payload-mib", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device: no GPU links to check"}))
        return
    nbytes = args.payload_mib << 20
    started = time.perf_counter()
    links = measure_links(torch, payload_bytes=nbytes)
    check_s = time.perf_counter() - started
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    best = min(_timed(lambda: b.copy_(a)) for _ in range(5))
    print(
        json.dumps(
            {
                "gpus": torch.cuda.device_count(),
                "name": torch.cuda.get_device_name(0),
                "payload_mib": args.payload_mib,
                "links_gbps": {f"{x.src}->{x.dst}": round(x.gbps, 1) for x in links},
                "slow": [f"{x.src}->{x.dst}" for x, _ in slow_links(links)],
                "baseline_same_device_gbps": round(nbytes / best / 1e9, 1),
                "check_s": round(check_s, 3),
            }
        )
    )


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
