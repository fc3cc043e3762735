"""Flash-checkpoint benchmark: ours and DLRover 0.6.1's side by side, on one state dict.

One run, one JSON line.  The state (`gpt_state`, defined once in checkpoint_dlrover_side.py;
both sides report its bytes, tensor count and an end-element checksum, asserted equal): 388
GPT-2-like tensors (32 blocks x 12 + wte/wpe/ln_f), even blocks' 2D weights fp32, odd ones' and
wte bf16, sized by --size-gib.  Order: our first saves, DLRover, the rest of ours.  DLRover runs
in its venv (--dlrover-venv; benchmarks/dlrover_venv.sh builds it; else `"dlrover": "skipped:
<why>"`) as DLRover starts it: its master by hand (`--standalone` crashes on torch 2.13), then
`dlrover-run --nproc_per_node=1`, whose agent runs the async saver (see that file).  Ours runs
here and in children, with its in-process saver (no agent): our persist thread shares the
trainer's process, DLRover's runs in its agent; on 2 cores both compete with the trainer.  Both
have torch's 2 intra-op threads.  `vs_dlrover` = ours / DLRover (< 1: ours is faster) of:

- first_save: a fresh process's first MEMORY save after building its state.  DLRover: 1 sample
  (worker incarnation 0, `DdpCheckpointer` built); ours: median of --reps processes.  Both run
  before this process grows: here first-touch faults cost 2-10x more once memory is held
  elsewhere or by the page cache (baselines-measured.md section 0), so order matters;
- warm_save: median of 4 x reps later MEMORY saves (ours: once its 2nd buffer is pre-faulted);
- disk_save_blocking: the DISK save call; persist: DISK save -> committed.  DLRover: its tracker
  `dlrover_latest.txt` shows the step (polled every 5 ms).  Its .pt is NOT fsynced:
  `persist_plus_fsync_s` adds an fsync after, and `persist_wait_latest_checkpoint_s` is one run
  of its own wait (polls every 3 s).  Ours: `wait_latest_checkpoint` (fsynced, commit record);
- save_during_persist: a MEMORY save 0.1 s after a DISK save returned (`_overlapped`: the persist
  still ran when it returned).  DLRover skips it while its saver holds the shm lock (one buffer;
  `_kept` false, ~1 ms, ratio "n/a"); ours has two buffers and copies, sharing the CPU;
- restore_memory: load + copy into the tensors of a restarted process.  DLRover: incarnation 0
  exits 17 after a MEMORY save, its agent restarts it (--max-restarts=1), incarnation 1 times
  `load_checkpoint()` (views over the agent's shm) + copy.  Ours: a new process, same job id,
  `load_checkpoint(state_dict=sd)`, which also verifies checksums (our default; DLRover doesn't);
- restore_storage: load + copy of the newest persisted step, page cache warm.  DLRover: a second
  dlrover-run (new run id, no shm: `torch.load`); ours: `load_checkpoint(memory=False)`.

Ours only: memcpy into a touched arena (the physical limit), a raw 64 MiB-write + fsync dump,
same-process restores, FsdpShardCheckpointer, torch.save, DCP save / async_save.  Run with
`nice`; --size-gib 1 needs about 8 GiB of RAM and 4 minutes.

    bash benchmarks/dlrover_venv.sh       # once: .venv-dlrover (torch 2.13.0 + dlrover 0.6.1)
    nice python benchmarks/checkpoint.py --size-gib 1 --out bench-1g.json
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.metadata
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

import checkpoint_dlrover_side as dlr  # noqa: E402
from checkpoint_dlrover_side import gpt_state  # noqa: E402

from dlrover_hpc.checkpoint import DdpCheckpointer, FsdpShardCheckpointer, StorageType  # noqa: E402
from dlrover_hpc.checkpoint.env import WorkerEnv  # noqa: E402

LAST_STEP = 999  # ours' last MEMORY save before the restart
GOALS = {"warm_save": 1.15, "first_save_vs_dlrover": 0.5, "persist": 0.8, "restore": 1.5}


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
    load_start = os.getloadavg()[0]  # other work on the machine skews every figure
    workdir = Path(args.dir)
    workdir.mkdir(parents=True, exist_ok=True)
    # first saves of both sides first, before this process grows (see the docstring)
    first = [_first_save_in_new_process(args.size_gib) for _ in range(args.reps)]
    dlrover = dlr.run_dlrover(
        args.dlrover_venv,
        size_gib=args.size_gib,
        reps=args.reps,
        workdir=workdir / "dlrover",
        timeout_s=args.dlrover_timeout,
    )
    sd = gpt_state(args.size_gib)  # (checkpoint_cuda.py imports gpt_state from here)
    if isinstance(dlrover, dict):
        mine = dlr.fingerprint(sd)
        assert dlrover.pop("state") == mine, f"DLRover saved another state than ours: {mine}"
    size = nbytes(sd)
    res: dict[str, Any] = {
        "size_bytes": size,
        "size_gib": round(size / 2**30, 3),
        "tensors": len(sd),
        "dlrover_hpc": importlib.metadata.version("dlrover-hpc"),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "reps": args.reps,
    }
    res.update(_ours(sd, workdir, args.reps, args.size_gib))
    gc.collect()
    res.update(_ours_fsdp(sd, workdir, args.reps))
    gc.collect()
    res["first_save_s"] = {"new_process_runs": [round(x, 4) for x in first], "median": med(first)}
    if not args.skip_baselines:
        res.update(_baselines(sd, workdir, args.reps))
    shutil.rmtree(workdir, ignore_errors=True)
    res["dlrover"] = dlrover
    if isinstance(dlrover, dict):
        res["vs_dlrover"] = dlr.ours_vs_dlrover(res, dlrover)
    mem = res["memcpy_s"]
    res["ratios"] = {
        "warm_save_vs_memcpy": round(res["warm_save_s"] / mem, 3),
        "persist_throughput_vs_raw_dump_fsync": round(
            res["raw_dump_fsync_s"] / res["persist_s"], 3
        ),
        "restore_memory_vs_memcpy": round(res["restore_memory_s"] / res["restore_memcpy_s"], 3),
    }
    res["goals"] = {
        "ratios.warm_save_vs_memcpy <=": GOALS["warm_save"],
        "vs_dlrover.first_save <=": GOALS["first_save_vs_dlrover"],
        "ratios.persist_throughput_vs_raw_dump_fsync >=": GOALS["persist"],
        "ratios.restore_memory_vs_memcpy <=": GOALS["restore"],
    }
    if "torch_save_disk_fsync_s" in res:
        res["ratios"]["torch_save_disk_fsync_vs_warm_save"] = round(
            res["torch_save_disk_fsync_s"] / res["warm_save_s"], 1
        )
        res["ratios"]["dcp_async_save_blocking_vs_warm_save"] = round(
            res["dcp_async_save_blocking_s"] / res["warm_save_s"], 1
        )
    res["loadavg_1m_start_end"] = [round(load_start, 2), round(os.getloadavg()[0], 2)]
    return res


def _ours(sd: dict[str, torch.Tensor], workdir: Path, reps: int, size_gib: float) -> dict:
    """Warm saves, DISK saves and restores, each interleaved with its baseline; saves during
    a persist; restores in a restarted process."""
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

    during, kept, overlapped = [], [], []
    for rep in range(reps):
        step = 200 + 2 * rep
        ck.save_checkpoint(step, sd, storage_type=StorageType.DISK)
        time.sleep(dlr.DURING_PERSIST_DELAY_S)
        t0 = time.perf_counter()
        kept.append(ck.save_checkpoint(step + 1, sd, storage_type=StorageType.MEMORY))
        during.append(time.perf_counter() - t0)
        overlapped.append(not ck.engine.wait_committed(step, 0.0))  # still persisting
        assert ck.wait_latest_checkpoint(600), "persist did not commit"
    out["save_during_persist_s"] = med(during)
    out["save_during_persist_kept"] = kept
    out["save_during_persist_overlapped"] = overlapped

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
    ck.save_checkpoint(LAST_STEP, sd, storage_type=StorageType.MEMORY)
    env = ck.engine.env
    ck.close(remove_segments=False)  # as a crashed process leaves them
    try:
        cmd = [sys.executable, __file__, "--restart-child", "--size-gib", str(size_gib)]
        cmd += ["--job-id", env.job_id, "--dir", str(workdir / "ckpt")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"restart child exited {done.returncode}:\n{done.stderr[-3000:]}")
        out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        for left in Path(env.shm_dir).glob(env.prefix + "*"):  # when the child failed
            left.unlink(missing_ok=True)
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


def _restart_child(args: argparse.Namespace) -> None:
    """The restarted process: its state dict built anew, then restored from memory, then from
    storage (once the restored step is persisted: without an agent, ours persists it here)."""
    sd = gpt_state(args.size_gib)
    ck = _checkpointer(Path(args.dir), keep_last=1, job_id=args.job_id)
    memory = timed(lambda: ck.load_checkpoint(state_dict=sd))
    restored = ck.last_restored
    assert restored == (LAST_STEP, "memory"), f"restored {restored}, not step {LAST_STEP}"
    assert ck.engine.wait_committed(LAST_STEP, 600)
    ck.engine.wait_prepared()
    storage = timed(lambda: ck.load_checkpoint(state_dict=sd, memory=False))
    assert ck.last_restored == (LAST_STEP, "storage"), ck.last_restored
    ck.close(remove_segments=True)
    res = {"restore_after_restart_s": memory, "restore_storage_after_restart_s": storage}
    print(json.dumps({k: round(v, 4) for k, v in res.items()}))


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


def _checkpointer(path: Path, *, keep_last: int, job_id: str = "") -> DdpCheckpointer:
    job_id = job_id or f"bench-{uuid.uuid4().hex[:8]}"
    env = WorkerEnv.from_environ({"DLROVER_HPC_JOB_ID": job_id})
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
    p.add_argument("--size-gib", type=float, default=0.5, help="state size (1 and 4 in reports)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=f"/tmp/dlrover-hpc-bench-{os.getpid()}", help="storage dir")
    p.add_argument("--threads", type=int, default=0, help="ours' torch threads (0: default)")
    p.add_argument("--skip-baselines", action="store_true", help="no torch.save / DCP runs")
    p.add_argument("--out", default=None, help="also write the JSON here (indented)")
    venv = REPO / ".venv-dlrover"
    p.add_argument(
        "--dlrover-venv",
        default=str(venv) if venv.exists() else "",
        help="DLRover 0.6.1's venv (default: .venv-dlrover when it exists; '' skips DLRover)",
    )
    p.add_argument("--dlrover-timeout", type=float, default=900.0, help="seconds per launch")
    p.add_argument("--first-save-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--job-id", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.first_save_child or args.restart_child:
        logging.basicConfig(level=logging.ERROR)
        if args.restart_child:
            _restart_child(args)
        else:
            _first_save_child(args.size_gib)
        return
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    res = bench(args)
    print(json.dumps(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
