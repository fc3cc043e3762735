"""Flash checkpoints of GPU tensors against the PCIe limit, all in one run, one JSON line.

The same 388-tensor GPT-like state dict (benchmarks/checkpoint.py) is built on the GPU, then,
interleaved rep by rep where it matters:

- the limits: a device-to-host copy into pinned host memory and back (one synchronise);
- the pageable copy a plain `tensor.cpu()`-style save pays, and `torch.save` to /dev/shm;
- the one-time preparation of a buffer: reserve + pre-fault + `cudaHostRegister`;
- ours with the on-device snapshot (the default): first save, warm saves (blocking = until
  `save_checkpoint` returns; `blocking_gpu` = until the device copy is done on the GPU;
  total = until the step is whole in shared memory), and restore into the CUDA tensors;
- ours with `device_snapshot=False` (pinned copies only): first and warm saves, restore;
- a restore in a fresh process (a restarted worker), which pins the segment it reads;
- checksums: the bytes in shared memory and the restored tensors equal the source;
- with --dlrover-run: examples/train_flash_ckpt.py under `dlrover-run --standalone` with NCCL,
  SIGKILLed at a step and resumed from memory into CUDA tensors.

    python benchmarks/checkpoint_cuda.py --size-gib 2 [--dlrover-run]

Needs a CUDA GPU; exits 2 with a message without one.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(REPO / "benchmarks"))

from checkpoint import gpt_state  # noqa: E402

from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType  # noqa: E402
from dlrover_hpc.checkpoint.env import WorkerEnv  # noqa: E402
from dlrover_hpc.checkpoint.saver.segments import HEADER_SIZE, Segment  # noqa: E402

GOALS = {
    "warm_blocking_vs_pinned_d2h": 1.2,
    "snapshot_blocking_vs_pinned_d2h": 0.2,
    "restore_vs_pinned_h2d": 1.5,
    "first_vs_2x_warm_plus_registration": 1.0,
}


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 5)


def copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
    sync()


def _env(job: str) -> WorkerEnv:
    return WorkerEnv.from_environ({"DLROVER_HPC_JOB_ID": job})


def _checkpointer(path: Path, job: str, *, snapshot: bool) -> DdpCheckpointer:
    return DdpCheckpointer(str(path), env=_env(job), keep_last=1, device_snapshot=snapshot)


def same_bytes(ck: DdpCheckpointer, sd: dict[str, torch.Tensor]) -> bool:
    """The newest step in shared memory equals the source, tensor by tensor (on the GPU)."""
    engine = ck.engine
    engine.wait_pending()
    newest = engine.memory_steps()
    ms = newest[max(newest)]
    slots = ms.header.meta["restore"]["slots"]
    assert ms.segment.mm is not None
    for i, t in enumerate(sd.values()):
        n = t.numel() * t.element_size()
        at = HEADER_SIZE + int(slots[str(i)])
        raw = torch.frombuffer(ms.segment.mm, dtype=torch.uint8, count=n, offset=at)
        if not torch.equal(raw.cuda(), t.view(-1).view(torch.uint8)):
            return False
    return True


def baselines(sd: dict[str, torch.Tensor], reps: int) -> dict[str, Any]:
    src = list(sd.values())
    pinned = [torch.empty_like(t, device="cpu", pin_memory=True) for t in src]
    pageable = [torch.zeros_like(t, device="cpu") for t in src]
    d2h, h2d, page = [], [], []
    for _ in range(reps):
        d2h.append(timed(lambda: copy_all(list(zip(pinned, src, strict=True)))))
        h2d.append(timed(lambda: copy_all(list(zip(src, pinned, strict=True)))))
        page.append(timed(lambda: [d.copy_(s) for d, s in zip(pageable, src, strict=True)]))
    pinned.clear()
    pageable.clear()
    shm = Path(tempfile.mkdtemp(prefix="dlrover-hpc-bench-", dir="/dev/shm"))
    try:
        tsave = timed(lambda: torch.save(sd, shm / "sd.pt"))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    return {
        "pinned_d2h_s": med(d2h),
        "pinned_h2d_s": med(h2d),
        "pageable_d2h_s": med(page),
        "torch_save_shm_s": round(tsave, 4),
    }


def registration(size: int, device: torch.device) -> dict[str, float]:
    """One buffer's one-time preparation, by part, on a fresh segment of the state's size."""
    from dlrover_hpc.checkpoint.trainer.cuda import register_host
    from dlrover_hpc.checkpoint.trainer.gpu_staging import PREFAULT_THREADS

    path = f"/dev/shm/dlrover-hpc-bench-reg-{uuid.uuid4().hex[:8]}"
    seg = Segment(path, writable=True)
    try:
        t0 = time.perf_counter()
        seg.ensure_size(size)
        t1 = time.perf_counter()
        seg.prefault(threads=PREFAULT_THREADS)
        t2 = time.perf_counter()
        seg.pin = register_host(seg.address(), seg.size, device)
        t3 = time.perf_counter()
        assert seg.pin is not None, "cudaHostRegister refused the segment"
        seg.release_pin()
        t4 = time.perf_counter()
    finally:
        seg.close()
        os.unlink(path)
    return {
        "reserve_s": round(t1 - t0, 4),
        "prefault_s": round(t2 - t1, 4),
        "register_s": round(t3 - t2, 4),
        "total_s": round(t3 - t0, 4),
        "unregister_s": round(t4 - t3, 4),
    }


def ours(sd: dict[str, torch.Tensor], workdir: Path, reps: int, *, snapshot: bool) -> dict:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    ck = _checkpointer(workdir / ("snap" if snapshot else "pin"), job, snapshot=snapshot)
    engine = ck.engine
    out: dict[str, Any] = {}

    def save(step: int) -> tuple[float, float, float]:
        sync()
        t0 = time.perf_counter()
        ck.save_checkpoint(step, sd, storage_type=StorageType.MEMORY)
        t1 = time.perf_counter()
        sync()  # the device copy (or the synchronous save) is done on the GPU
        t2 = time.perf_counter()
        engine.wait_pending()  # the step is whole in shared memory
        t3 = time.perf_counter()
        return t1 - t0, t2 - t0, t3 - t0

    first = save(1)
    out["first_save_blocking_s"] = round(first[0], 4)
    out["first_save_total_s"] = round(first[2], 4)
    engine.wait_prepared()  # the second buffer is reserved, pre-faulted and pinned
    save(2)
    blocking, gpu, total = [], [], []
    for step in range(3, 3 + 4 * reps):
        b, g, t = save(step)
        blocking.append(b)
        gpu.append(g)
        total.append(t)
    out["warm_blocking_s"] = med(blocking)
    out["warm_blocking_gpu_s"] = med(gpu)
    out["warm_total_s"] = med(total)
    if snapshot:  # back to back: the second save waits for the first one's drain
        ck.save_checkpoint(90, sd, storage_type=StorageType.MEMORY)
        out["back_to_back_blocking_s"] = round(save(91)[0], 4)
    out["shm_bytes_equal_source"] = same_bytes(ck, sd)
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    restore = []
    for _ in range(reps):
        for t in targets.values():
            t.zero_()
        restore.append(timed(lambda: ck.load_checkpoint(state_dict=targets)))
    out["restore_s"] = med(restore)
    out["restore_source"] = ck.last_restored[1] if ck.last_restored else None
    out["restored_equal_source"] = all(torch.equal(targets[k], sd[k]) for k in sd)
    out["job"] = job
    out["dir"] = str(workdir / ("snap" if snapshot else "pin"))
    out["_ck"] = ck
    return out


def restore_in_new_process(
    job: str, ckpt_dir: str, size_gib: float, *, pinned_ahead: bool
) -> dict[str, Any]:
    """A restarted worker's restore: right after constructing the checkpointer (the segment
    is not page-locked yet), or after its background pinning finished (`pinned_ahead`: a
    script that constructs the checkpointer before building its model gets this)."""
    cmd = [sys.executable, __file__, "--restore-child", job, ckpt_dir, "--size-gib", str(size_gib)]
    if pinned_ahead:
        cmd.append("--pinned-ahead")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _restore_child(job: str, ckpt_dir: str, size_gib: float, pinned_ahead: bool) -> None:
    torch.cuda.set_device(0)
    sd = gpt_state(size_gib, "cuda")
    targets = {k: torch.zeros_like(v) for k, v in sd.items()}
    sync()
    t0 = time.perf_counter()
    ck = DdpCheckpointer(ckpt_dir, env=_env(job), keep_last=1)
    if pinned_ahead:
        ck.engine.wait_prepared()
    t1 = time.perf_counter()
    ck.load_checkpoint(state_dict=targets)
    sync()
    t2 = time.perf_counter()
    equal = all(torch.equal(targets[k], sd[k]) for k in sd)
    source = ck.last_restored[1] if ck.last_restored else None
    ck.close(remove_segments=False)
    print(
        json.dumps(
            {
                "construct_s": round(t1 - t0, 4),
                "load_s": round(t2 - t1, 4),
                "total_s": round(t2 - t0, 4),
                "source": source,
                "restored_equal_source": equal,
            }
        )
    )


def dlrover_run_resume(workdir: Path) -> dict[str, Any]:
    """A worker SIGKILLed mid-training under dlrover-run resumes from memory into CUDA."""
    result = workdir / "resume.json"
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [
        sys.executable,
        "-m",
        "dlrover_hpc.cli.run",
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=2",
        str(REPO / "examples" / "train_flash_ckpt.py"),
        "--backend=nccl",
        "--steps=30",
        "--save-every=2",
        "--persist-every=10",
        "--fail-at-step=13",
        f"--ckpt-dir={workdir / 'resume-ckpt'}",
        f"--result={result}",
    ]
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env=env, cwd=workdir
    )
    out: dict[str, Any] = {"rc": done.returncode, "seconds": round(time.perf_counter() - t0, 2)}
    if result.exists():
        out.update(json.loads(result.read_text()))
    else:
        out["log_tail"] = (done.stdout + done.stderr)[-3000:]
    out["ok"] = (
        done.returncode == 0
        and out.get("restored") == [12, "memory"]
        and out.get("restart_count") == 1
        and out.get("backend") == "nccl"
        and str(out.get("device", "")).startswith("cuda")
    )
    return out


def bench(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sd = gpt_state(args.size_gib, "cuda")
    size = sum(t.numel() * t.element_size() for t in sd.values())
    res: dict[str, Any] = {
        "size_gib": round(size / 2**30, 3),
        "tensors": len(sd),
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    res["limits"] = baselines(sd, args.reps)
    res["registration"] = registration(size, device)
    workdir = Path(tempfile.mkdtemp(prefix="dlrover-hpc-cuda-bench-"))
    try:
        snap = ours(sd, workdir, args.reps, snapshot=True)
        ck = snap.pop("_ck")
        job, ckpt_dir = snap.pop("job"), snap.pop("dir")
        for ahead in (False, True):
            key = "restore_new_process" + ("_pinned_ahead" if ahead else "")
            snap[key] = restore_in_new_process(job, ckpt_dir, args.size_gib, pinned_ahead=ahead)
        ck.close(remove_segments=True)
        pin = ours(sd, workdir, args.reps, snapshot=False)
        pin.pop("_ck").close(remove_segments=True)
        pin.pop("job"), pin.pop("dir")
        res["ours_snapshot"] = snap
        res["ours_pinned"] = pin
        if args.dlrover_run:
            res["dlrover_run_nccl_resume"] = dlrover_run_resume(workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    lim = res["limits"]
    reg = res["registration"]["total_s"]
    res["ratios"] = {
        "pinned_warm_blocking_vs_pinned_d2h": round(
            pin["warm_blocking_s"] / lim["pinned_d2h_s"], 3
        ),
        "snapshot_blocking_vs_pinned_d2h": round(snap["warm_blocking_s"] / lim["pinned_d2h_s"], 3),
        "snapshot_blocking_gpu_vs_pinned_d2h": round(
            snap["warm_blocking_gpu_s"] / lim["pinned_d2h_s"], 3
        ),
        "snapshot_total_vs_pinned_d2h": round(snap["warm_total_s"] / lim["pinned_d2h_s"], 3),
        "restore_vs_pinned_h2d": round(pin["restore_s"] / lim["pinned_h2d_s"], 3),
        "restore_snapshot_mode_vs_pinned_h2d": round(snap["restore_s"] / lim["pinned_h2d_s"], 3),
        "snapshot_first_vs_2x_warm_plus_registration": round(
            snap["first_save_blocking_s"] / (2 * snap["warm_blocking_gpu_s"] + reg), 3
        ),
        "pinned_first_vs_2x_warm_plus_registration": round(
            pin["first_save_blocking_s"] / (2 * pin["warm_blocking_s"] + reg), 3
        ),
        "pageable_d2h_vs_pinned_d2h": round(lim["pageable_d2h_s"] / lim["pinned_d2h_s"], 3),
        "torch_save_shm_vs_pinned_d2h": round(lim["torch_save_shm_s"] / lim["pinned_d2h_s"], 1),
    }
    res["goals"] = GOALS
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gib", type=float, default=2.0)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dlrover-run", action="store_true", help="also the NCCL resume test")
    p.add_argument("--restore-child", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--pinned-ahead", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        print("checkpoint_cuda.py needs a CUDA GPU; none is visible to torch", file=sys.stderr)
        sys.exit(2)
    if args.restore_child:
        _restore_child(*args.restore_child, args.size_gib, args.pinned_ahead)
        return
    print(json.dumps(bench(args)))


if __name__ == "__main__":
    main()
