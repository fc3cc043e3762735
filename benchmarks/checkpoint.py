"""Flash-checkpoint benchmark: blocking save, first save, persist throughput, restore.

One process, one run, all numbers side by side, printed as JSON:

- state dict: GPT-2-like, 32 blocks x 12 tensors + wte/wpe/ln_f = 388 tensors, 2D weights of
  even blocks fp32 and of odd blocks bf16 (wte bf16), sized by --size-gib;
- memcpy: the same tensors copied into a preallocated, touched arena (the physical limit);
- first save: a new checkpointer (new segments) saving once; warm save: later MEMORY saves;
- persist: DISK save -> committed (written, fsynced, renamed, commit record) vs a raw dump of
  the same bytes in 64 MiB writes + fsync (interleaved, medians);
- restore: load_checkpoint into the existing tensors from memory, and from storage;
- torch.save (/dev/shm, disk+fsync), torch.load, DCP save and async_save, on the same state.

DLRover 0.6.1 is not run here (it needs its own venv and a hand-started master); its measured
first save on this machine (2.5 s for 0.95 GiB, baselines-measured.md section 3) is the
reference for the first-save goal.  Run with `nice`; the 4 GiB size needs about 18 GiB of RAM.

    nice python benchmarks/checkpoint.py --size-gib 1 --out bench-1g.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dlrover_hpc.checkpoint import DdpCheckpointer, FsdpShardCheckpointer, StorageType  # noqa: E402
from dlrover_hpc.checkpoint.env import WorkerEnv  # noqa: E402

DLROVER_FIRST_SAVE_S = 2.5  # baselines-measured.md section 3, 0.95 GiB, dlrover 0.6.1
GOALS = {"warm_save": 1.15, "first_save_vs_dlrover": 0.5, "persist": 0.8, "restore": 1.5}


def gpt_state(size_gib: float, device: str = "cpu") -> dict[str, torch.Tensor]:
    """388 tensors like GPT-2 blocks; hidden size chosen to reach `size_gib`."""
    target = size_gib * 2**30
    hidden = 64
    while _bytes(hidden + 8) <= target:
        hidden += 8
    return _make(hidden, device)


def _bytes(h: int) -> int:
    return 1152 * h * h + 1664 * h + 50257 * h * 2 + 1024 * h * 4 + 8 * h


def _make(h: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(0)
    sd: dict[str, torch.Tensor] = {}

    def t(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    sd["wte.weight"] = t((50257, h), torch.bfloat16)
    sd["wpe.weight"] = t((1024, h), torch.float32)
    for i in range(32):
        w = torch.float32 if i % 2 == 0 else torch.bfloat16
        p = f"h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = t((h,), torch.float32), t((h,), torch.float32)
        sd[p + "attn.c_attn.weight"] = t((h, 3 * h), w)
        sd[p + "attn.c_attn.bias"] = t((3 * h,), torch.float32)
        sd[p + "attn.c_proj.weight"] = t((h, h), w)
        sd[p + "attn.c_proj.bias"] = t((h,), torch.float32)
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = t((h,), torch.float32), t((h,), torch.float32)
        sd[p + "mlp.c_fc.weight"] = t((h, 4 * h), w)
        sd[p + "mlp.c_fc.bias"] = t((4 * h,), torch.float32)
        sd[p + "mlp.c_proj.weight"] = t((4 * h, h), w)
        sd[p + "mlp.c_proj.bias"] = t((h,), torch.float32)
    sd["ln_f.weight"], sd["ln_f.bias"] = t((h,), torch.float32), t((h,), torch.float32)
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


class Arena:
    """A preallocated, touched flat buffer with one view per tensor (the memcpy baseline)."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        total = sum((v.numel() * v.element_size() + 63) // 64 * 64 for v in sd.values())
        self.flat = torch.zeros(total, dtype=torch.uint8)
        self.views, off = [], 0
        for v in sd.values():
            n = v.numel() * v.element_size()
            self.views.append(self.flat[off : off + n].view(v.dtype).view(v.shape))
            off += (n + 63) // 64 * 64

    def copy_from(self, sd: dict[str, torch.Tensor]) -> None:
        for dst, src in zip(self.views, sd.values(), strict=True):
            dst.copy_(src)


def raw_dump(arena: Arena, path: Path) -> float:
    """Writes the arena in 64 MiB chunks and fsyncs it (the disk's physical limit)."""
    buf = _as_buffer(arena.flat)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for start in range(0, len(buf), 64 << 20):
            chunk = buf[start : start + (64 << 20)]
            written = 0
            while written < len(chunk):
                written += os.write(fd, chunk[written:])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _as_buffer(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (no numpy needed)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    sd = gpt_state(args.size_gib)
    size = nbytes(sd)
    res: dict[str, Any] = {
        "size_bytes": size,
        "size_gib": round(size / 2**30, 3),
        "tensors": len(sd),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "reps": args.reps,
    }
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    res.update(_ours(sd, workdir, args.reps))
    gc.collect()
    res.update(_ours_fsdp(sd, workdir, args.reps))
    gc.collect()
    first = [_first_save_in_new_process(args.size_gib) for _ in range(args.reps)]
    res["first_save_s"] = {"new_process_runs": [round(x, 4) for x in first], "median": med(first)}
    if not args.skip_baselines:
        res.update(_baselines(sd, workdir, args.reps))
    shutil.rmtree(workdir, ignore_errors=True)

    res["dlrover_0_6_1"] = {
        "ran": False,
        "first_save_s": DLROVER_FIRST_SAVE_S,
        "note": "not run here; measured on this machine in baselines-measured.md section 3",
    }
    mem = res["memcpy_s"]
    res["ratios"] = {
        "warm_save_vs_memcpy": round(res["warm_save_s"] / mem, 3),
        "first_save_vs_dlrover_first_save_scaled_to_size": round(
            res["first_save_s"]["median"] / (DLROVER_FIRST_SAVE_S * size / (0.95 * 2**30)), 3
        ),
        "persist_throughput_vs_raw_dump_fsync": round(
            res["raw_dump_fsync_s"] / res["persist_s"], 3
        ),
        "restore_memory_vs_memcpy": round(res["restore_memory_s"] / res["restore_memcpy_s"], 3),
    }
    res["goals"] = {
        "warm_save_vs_memcpy <=": GOALS["warm_save"],
        "first_save_vs_dlrover_first_save_scaled_to_size <=": GOALS["first_save_vs_dlrover"],
        "persist_throughput_vs_raw_dump_fsync >=": GOALS["persist"],
        "restore_memory_vs_memcpy <=": GOALS["restore"],
    }
    if "torch_save_disk_fsync_s" in res:
        res["ratios"]["torch_save_disk_fsync_vs_warm_save"] = round(
            res["torch_save_disk_fsync_s"] / res["warm_save_s"], 1
        )
        res["ratios"]["dcp_async_save_blocking_vs_warm_save"] = round(
            res["dcp_async_save_blocking_s"] / res["warm_save_s"], 1
        )
    return res


def _ours(sd: dict[str, torch.Tensor], workdir: Path, reps: int) -> dict[str, Any]:
    """Warm saves, DISK saves and restores, each interleaved with its baseline."""
    size = nbytes(sd)
    arena = Arena(sd)
    arena.copy_from(sd)
    out: dict[str, Any] = {}
    ck = _checkpointer(workdir / "ckpt", keep_last=1)
    ck.save_checkpoint(0, sd, storage_type=StorageType.MEMORY)
    ck.engine.wait_prepared()  # the second buffer is created and pre-faulted
    ck.save_checkpoint(0, sd, storage_type=StorageType.MEMORY)
    memcpy, warm = [], []
    for step in range(1, 4 * reps + 1):
        memcpy.append(timed(lambda: arena.copy_from(sd)))
        warm.append(
            timed(lambda s=step: ck.save_checkpoint(s, sd, storage_type=StorageType.MEMORY))
        )
    out["memcpy_s"] = med(memcpy)
    out["memcpy_gbps"] = round(size / statistics.median(memcpy) / 1e9, 2)
    out["warm_save_s"] = med(warm)
    out["warm_save_gbps"] = round(size / statistics.median(warm) / 1e9, 2)
    out["warm_save_vs_memcpy_pairs_median"] = med(
        [w / m for w, m in zip(warm, memcpy, strict=True)]
    )

    persist, raw, blocking = [], [], []
    for rep in range(reps):
        raw.append(raw_dump(arena, workdir / "raw.bin"))
        (workdir / "raw.bin").unlink()
        t0 = time.perf_counter()
        ck.save_checkpoint(100 + rep, sd, storage_type=StorageType.DISK)
        blocking.append(time.perf_counter() - t0)
        assert ck.wait_latest_checkpoint(600), "persist did not commit"
        persist.append(time.perf_counter() - t0)
    out["disk_save_blocking_s"] = med(blocking)
    out["persist_s"] = med(persist)
    out["persist_gbps"] = round(size / statistics.median(persist) / 1e9, 2)
    out["raw_dump_fsync_s"] = med(raw)
    out["raw_dump_fsync_gbps"] = round(size / statistics.median(raw) / 1e9, 2)

    restore, memcpy2 = [], []
    for _ in range(2 * reps):
        memcpy2.append(timed(lambda: arena.copy_from(sd)))
        restore.append(timed(lambda: ck.load_checkpoint(state_dict=sd)))
    out["restore_memory_s"] = med(restore)
    out["restore_memory_vs_memcpy_pairs_median"] = med(
        [r / m for r, m in zip(restore, memcpy2, strict=True)]
    )
    out["restore_memcpy_s"] = med(memcpy2)
    out["restore_storage_s"] = med(
        [timed(lambda: ck.load_checkpoint(state_dict=sd, memory=False)) for _ in range(reps)]
    )
    ck.close(remove_segments=True)
    return out


def _ours_fsdp(sd: dict[str, torch.Tensor], workdir: Path, reps: int) -> dict[str, Any]:
    """FsdpShardCheckpointer (DCP planning + shared memory) on the same state, one process."""
    env = WorkerEnv.from_environ({"DLROVER_HPC_JOB_ID": f"bench-{uuid.uuid4().hex[:8]}"})
    ck = FsdpShardCheckpointer(str(workdir / "fsdp"), env=env, keep_last=1)
    state = {"model": sd}
    for step in range(2):
        ck.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
        ck.engine.wait_prepared()
    warm = [
        timed(lambda s=s: ck.save_checkpoint(s, state, storage_type=StorageType.MEMORY))
        for s in range(2, 2 + 2 * reps)
    ]
    t0 = time.perf_counter()
    ck.save_checkpoint(100, state, storage_type=StorageType.DISK)
    assert ck.wait_latest_checkpoint(600)
    persist = time.perf_counter() - t0
    ck.close(remove_segments=True)
    return {"fsdp_warm_save_s": med(warm), "fsdp_save_to_committed_s": round(persist, 4)}


def _first_save_in_new_process(size_gib: float) -> float:
    """A job's first save: a fresh process that has just built its state dict."""
    cmd = [sys.executable, __file__, "--first-save-child", "--size-gib", str(size_gib)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["first_save_s"])


def _first_save_child(size_gib: float) -> None:
    sd = gpt_state(size_gib)
    with tempfile.TemporaryDirectory(prefix="dlrover-hpc-first-") as d:
        ck = _checkpointer(Path(d), keep_last=1)
        seconds = timed(lambda: ck.save_checkpoint(1, sd, storage_type=StorageType.MEMORY))
        ck.close(remove_segments=True)
    print(json.dumps({"first_save_s": seconds}))


def _checkpointer(path: Path, *, keep_last: int) -> DdpCheckpointer:
    env = WorkerEnv.from_environ({"DLROVER_HPC_JOB_ID": f"bench-{uuid.uuid4().hex[:8]}"})
    return DdpCheckpointer(str(path), env=env, keep_last=keep_last, verify=True)


def _baselines(sd: dict[str, torch.Tensor], workdir: Path, reps: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, Any] = {}
    shm = Path(tempfile.mkdtemp(prefix="dlrover-hpc-bench-", dir="/dev/shm"))
    try:
        t = [timed(lambda: torch.save(sd, shm / "sd.pt")) for _ in range(reps)]
        out["torch_save_shm_s"] = med(t)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    disk, load = [], []
    for _ in range(reps):
        path = workdir / "torch.pt"

        def save_fsync(path: Path = path) -> None:
            with open(path, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())

        disk.append(timed(save_fsync))
        load.append(timed(lambda path=path: torch.load(path)))
        path.unlink()
    out["torch_save_disk_fsync_s"] = med(disk)
    out["torch_load_disk_s"] = med(load)
    sync, blocking, complete = [], [], []
    for rep in range(reps):
        d = workdir / f"dcp{rep}"
        sync.append(timed(lambda d=d: dcp.save(sd, checkpoint_id=str(d / "s"))))
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, checkpoint_id=str(d / "a"))
        blocking.append(time.perf_counter() - t0)
        fut.result()
        complete.append(time.perf_counter() - t0)
        shutil.rmtree(d, ignore_errors=True)
        gc.collect()
    out["dcp_save_s"] = med(sync)
    out["dcp_async_save_blocking_s"] = med(blocking)
    out["dcp_async_save_complete_s"] = med(complete)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=0.25, help="state size (1 and 4 in reports)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=f"/tmp/dlrover-hpc-bench-{os.getpid()}", help="storage dir")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument("--skip-baselines", action="store_true", help="no torch.save / DCP runs")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--first-save-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_save_child:
        logging.basicConfig(level=logging.ERROR)
        _first_save_child(args.size_gib)
        return
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = bench(args)
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
