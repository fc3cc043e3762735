"""What the finite check of a restore costs, against the restore's own copy, in one run.

One process, its in-process saver, the real /dev/shm: a GPT-like state of --size-mib (fp32
and bf16 weights in 2D tensors, fp32 biases; --tensors of them) is saved to memory, then
restored --reps times into the same tensors without the check (``check_finite=False``: the
copy, the baseline) and with the check on (the default), alternating.  Also
timed alone: `first_nonfinite` on the restored state (all finite: one sum per tensor), and
on a state whose last tensor holds a NaN (the exact pass that finds and names it).  Medians;
``ms_per_gib`` divides by the state's bytes.  With CUDA (--device cuda) the state restores
into GPU tensors and the check runs there.

    python benchmarks/restore_check.py --size-mib 512 --reps 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.testing import remove_job_segments
from dlrover_hpc.checkpoint.trainer.restore_check import (
    RestoreCheck,
    first_nonfinite,
)


def state_of(size_mib: int, tensors: int, device: str) -> dict[str, Any]:
    per = size_mib * 2**20 // tensors
    model: dict[str, torch.Tensor] = {}
    for i in range(tensors):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = max(1, per // (cols * torch.finfo(dtype).bits // 8))
        model[f"h.{i}.weight"] = torch.randn(rows, cols, device=device).to(dtype)
        model[f"h.{i}.bias"] = torch.randn(cols, device=device)
    return {"model": model, "step": 1}


def nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def median_s(fn: Any, reps: int, sync: Any) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    job = f"b{uuid.uuid4().hex[:10]}"
    env = {"DLROVER_HPC_JOB_ID": job, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    worker = WorkerEnv.from_environ({**env, "LOCAL_WORLD_SIZE": "1"})
    state = state_of(args.size_mib, args.tensors, args.device)
    size = nbytes(state)
    out: dict[str, Any] = {
        "bench": "restore_check",
        "state_mib": round(size / 2**20, 1),
        "tensors": len(state["model"]),
        "device": args.device,
        "threads": torch.get_num_threads(),
        "reps": args.reps,
    }
    with tempfile.TemporaryDirectory() as root:
        ck = DdpCheckpointer(root, env=worker)
        on, off = ck.restore_check, RestoreCheck(finite=False)

        def restore(check: RestoreCheck) -> None:
            ck.restore_check = check
            ck.load_checkpoint(state_dict=target)

        try:
            assert ck.save_checkpoint(1, state, storage_type=StorageType.MEMORY)
            target = state_of(args.size_mib, args.tensors, args.device)
            restore(off)  # warm: mappings, page tables
            restore(on)
            pairs = []
            for _ in range(args.reps):  # alternating, so drift hits both alike
                pairs.append(
                    (
                        median_s(lambda: restore(off), 1, sync),
                        median_s(lambda: restore(on), 1, sync),
                    )
                )
            assert ck.last_restored == (1, "memory")
        finally:
            ck.close(remove_segments=True)
            remove_job_segments(job)
    restore_s = statistics.median(a for a, _ in pairs)
    restore_checked_s = statistics.median(b for _, b in pairs)
    check_s = median_s(lambda: first_nonfinite(target), args.reps, sync)
    last = list(target["model"].values())[-1]
    last.view(-1)[-1] = float("nan")
    found = first_nonfinite(target)
    assert found is not None and "nan" in found, found
    check_nan_s = median_s(lambda: first_nonfinite(target), args.reps, sync)
    gib = size / 2**30
    out.update(
        restore_s=round(restore_s, 4),
        restore_checked_s=round(restore_checked_s, 4),
        check_s=round(check_s, 4),
        check_with_nan_s=round(check_nan_s, 4),
        restore_ms_per_gib=round(restore_s * 1000 / gib, 1),
        check_ms_per_gib=round(check_s * 1000 / gib, 1),
        check_with_nan_ms_per_gib=round(check_nan_s * 1000 / gib, 1),
        check_vs_restore=round(check_s / restore_s, 3),
        restore_checked_vs_restore=round(restore_checked_s / restore_s, 3),
        pid=os.getpid(),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
