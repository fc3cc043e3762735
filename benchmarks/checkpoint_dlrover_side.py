"""DLRover 0.6.1's side of benchmarks/checkpoint.py: its flash checkpoint, started as DLRover
starts it, on the same GPT-2-like state dict.

Two roles in one file, so that the state dict is defined once:

- `gpt_state()`, `fingerprint()`, `run_dlrover()` / `launch()` and `ours_vs_dlrover()`, imported
  by benchmarks/checkpoint.py (our venv; these need only the stdlib and torch);
- the training script that `launch()` runs under DLRover's own `dlrover-run`, in DLRover's venv
  (benchmarks/dlrover_venv.sh).  It imports torch and dlrover only, never dlrover_hpc.

`launch()` works around `dlrover-run --standalone` crashing on torch 2.13 (baselines-measured.md
section 3): it starts DLRover's local master by hand, then `dlrover-run` pointed at it, one
worker (`--nproc_per_node=1`), so DLRover's agent starts its async saver, as in a real job.  Two
launches, each with its own master and a unique `ELASTIC_JOB_NAME` (DLRover's run id, which
names its shm segment `/dev/shm/<run id>_ckpt_shm_0` and `/tmp/ckpt_sock/<run id>/`):

1. `--phase save`, `--max-restarts=1`.  Incarnation 0 (TORCHELASTIC_RESTART_COUNT=0) times the
   first MEMORY save, warm MEMORY saves, DISK saves until the tracker file shows the step, and
   MEMORY saves issued while a persist runs; it ends with a MEMORY save of a marked step and
   exits 17.  The agent restarts the worker; incarnation 1 builds its state dict anew and times
   `load_checkpoint()` (served from the agent's shm) plus the copy into its tensors.  Its
   `DdpCheckpointer` keeps the newest step on storage (`KeepLatestStepStrategy(1)`), as ours.
2. `--phase load-storage`: a new launch, so a new run id and no shm (DLRover never finds a
   previous launch's segment): `load_checkpoint()` reads the tracker and `torch.load`s the file.

Afterwards both process groups are killed and the shm segments and socket dirs of those two run
ids are removed (DLRover leaves them behind even on success); they are reported as `leaked`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

EXIT_AFTER_SAVE = 17  # incarnation 0's planned failure, so that the agent restarts it
MARK = "ln_f.bias"  # its [0] holds the step of the last save, to check what was restored
DURING_PERSIST_DELAY_S = 0.1  # the MEMORY save starts this long after the DISK save returned


# ------------------------------------------------------------------------ the state dict
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


def fingerprint(sd: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What both sides report so that checkpoint.py can assert they saved the same state."""
    ends = sum(float(v.view(-1)[0]) + float(v.view(-1)[-1]) for v in sd.values())
    return {
        "bytes": sum(v.numel() * v.element_size() for v in sd.values()),
        "tensors": len(sd),
        "ends_sum": round(ends, 6),
    }


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


# ------------------------------------------------------------------------ the worker (DLRover venv)
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from dlrover.python.common.storage import KeepLatestStepStrategy
    from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

    dist.init_process_group("gloo")
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.exists() else {}
    sd = gpt_state(args.size_gib)
    ckpt_dir = args.ckpt_dir
    strategy = KeepLatestStepStrategy(max_to_keep=1, checkpoint_dir=ckpt_dir)
    t0 = time.perf_counter()
    ck = DdpCheckpointer(ckpt_dir, deletion_strategy=strategy)
    init_s = time.perf_counter() - t0
    if args.phase == "load-storage":
        res["storage"] = _restore(ck, sd, init_s)
    elif incarnation == 0:
        res["state"] = fingerprint(sd)
        res["env"] = {
            "dlrover": importlib.metadata.version("dlrover"),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID"),
        }
        res["save"] = _saves(ck, sd, StorageType, ckpt_dir, args.reps)
        res["save"]["init_s"] = round(init_s, 4)
    else:
        res["restart"] = _restore(ck, sd, init_s)
        res["restart"]["incarnation"] = incarnation
    out.write_text(json.dumps(res))
    if args.phase == "save" and incarnation == 0:
        dist.destroy_process_group()
        sys.exit(EXIT_AFTER_SAVE)


def _saves(ck: Any, sd: dict[str, torch.Tensor], st: Any, ckpt_dir: str, reps: int) -> dict:
    engine = ck._engine  # read only: the step held in shm, to see whether a save was skipped
    out: dict[str, Any] = {}
    out["first_save_s"] = round(
        _timed(lambda: ck.save_checkpoint(1, sd, storage_type=st.MEMORY)), 4
    )
    warm = [
        _timed(lambda s=s: ck.save_checkpoint(s, sd, storage_type=st.MEMORY))
        for s in range(2, 2 + 4 * reps)
    ]
    out["warm_save_s"] = _med(warm)
    out["warm_save_runs"] = [round(x, 4) for x in warm]
    step = 100
    blocking, persist, fsync = [], [], []
    for _ in range(reps):
        step += 1
        sd[MARK][0] = float(step)
        t0 = time.perf_counter()
        ck.save_checkpoint(step, sd, storage_type=st.DISK)
        blocking.append(time.perf_counter() - t0)
        persist.append(_wait_tracker(ckpt_dir, step) - t0)
        fsync.append(_timed(lambda s=step: _fsync(Path(ckpt_dir, str(s), "rank_0.pt"))))
    out["disk_save_blocking_s"] = _med(blocking)
    out["persist_s"] = _med(persist)
    out["persist_runs"] = [round(x, 4) for x in persist]
    out["fsync_after_commit_s"] = _med(fsync)
    out["persist_plus_fsync_s"] = _med([p + f for p, f in zip(persist, fsync, strict=True)])
    step += 1  # DLRover's own wait (it polls the tracker every 3 s)
    sd[MARK][0] = float(step)
    t0 = time.perf_counter()
    ck.save_checkpoint(step, sd, storage_type=st.DISK)
    ck.wait_latest_checkpoint(600)
    out["persist_wait_latest_checkpoint_s"] = round(time.perf_counter() - t0, 4)
    during, kept, overlapped = [], [], []
    for _ in range(reps):
        step += 2
        sd[MARK][0] = float(step - 1)
        ck.save_checkpoint(step - 1, sd, storage_type=st.DISK)
        time.sleep(DURING_PERSIST_DELAY_S)
        during.append(_timed(lambda s=step: ck.save_checkpoint(s, sd, storage_type=st.MEMORY)))
        overlapped.append(_tracker_step(ckpt_dir) != step - 1)  # still persisting at return
        kept.append(engine._cached_step == step)
        _wait_tracker(ckpt_dir, step - 1)
    out["save_during_persist_s"] = _med(during)
    out["save_during_persist_kept"] = kept
    out["save_during_persist_overlapped"] = overlapped
    out["last_disk_step"] = step - 1
    step += 1  # the step the restarted worker must find in memory
    sd[MARK][0] = float(step)
    ck.save_checkpoint(step, sd, storage_type=st.MEMORY)
    out["last_memory_step"] = step
    out["last_memory_step_kept"] = engine._cached_step == step
    return out


def _wait_tracker(ckpt_dir: str, step: int, timeout_s: float = 600.0) -> float:
    """When DLRover's tracker file first shows `step` (polled every 5 ms): committed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _tracker_step(ckpt_dir) == step:
            return time.perf_counter()
        time.sleep(0.005)
    raise TimeoutError(f"{ckpt_dir}/dlrover_latest.txt did not show {step} within {timeout_s} s")


def _tracker_step(ckpt_dir: str) -> int | None:
    try:
        return int(Path(ckpt_dir, "dlrover_latest.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _restore(ck: Any, sd: dict[str, torch.Tensor], init_s: float) -> dict[str, Any]:
    """`load_checkpoint()`, then the copy into the existing tensors (as load_state_dict)."""
    t0 = time.perf_counter()
    loaded = ck.load_checkpoint()
    load_s = time.perf_counter() - t0
    assert loaded, "DLRover's load_checkpoint() found no checkpoint"
    for k, v in sd.items():
        v.copy_(loaded[k])
    total_s = time.perf_counter() - t0
    return {
        "init_s": round(init_s, 4),
        "load_checkpoint_s": round(load_s, 4),
        "load_and_copy_s": round(total_s, 4),
        "step_mark": float(sd[MARK][0]),
    }


# ------------------------------------------------------------------------ the launcher (our venv)
def run_dlrover(
    venv: str, *, size_gib: float, reps: int, workdir: Path, timeout_s: float
) -> dict[str, Any] | str:
    """`launch()`'s figures, or why they are missing ("skipped: ...")."""
    if not venv or not Path(venv, "bin", "dlrover-run").exists():
        return f"skipped: no DLRover venv at {venv!r} (build it: bash benchmarks/dlrover_venv.sh)"
    try:
        return launch(
            Path(venv).resolve(), size_gib=size_gib, reps=reps, workdir=workdir, timeout_s=timeout_s
        )
    except (RuntimeError, OSError, ValueError) as exc:
        return f"skipped: DLRover failed: {exc}"


def ours_vs_dlrover(res: dict[str, Any], dl: dict[str, Any]) -> dict[str, Any]:
    """ours / DLRover for each figure both sides have (< 1: ours is faster)."""
    save, restart, storage = dl["save"], dl["restart"], dl["storage"]
    pairs = {
        "first_save": (res["first_save_s"]["median"], save["first_save_s"]),
        "warm_save": (res["warm_save_s"], save["warm_save_s"]),
        "disk_save_blocking": (res["disk_save_blocking_s"], save["disk_save_blocking_s"]),
        "save_during_persist": (res["save_during_persist_s"], save["save_during_persist_s"]),
        "persist": (res["persist_s"], save["persist_s"]),
        "persist_vs_dlrover_plus_fsync": (res["persist_s"], save["persist_plus_fsync_s"]),
        "restore_memory": (res["restore_after_restart_s"], restart["load_and_copy_s"]),
        "restore_storage": (res["restore_storage_after_restart_s"], storage["load_and_copy_s"]),
    }
    out: dict[str, Any] = {k: round(a / b, 3) for k, (a, b) in pairs.items()}
    if not any(save["save_during_persist_kept"]):  # DLRover returned at once, saving nothing
        out["save_during_persist"] = "n/a: DLRover skipped each of these saves"
    out["save_during_persist_kept"] = {
        "ours": res["save_during_persist_kept"],
        "dlrover": save["save_during_persist_kept"],
    }
    return out


def launch(
    venv: Path, *, size_gib: float, reps: int, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """Runs both phases under DLRover's own master + dlrover-run; returns the worker's figures
    with `leaked` (what DLRover left behind); raises RuntimeError with the log's tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "dlrover.json"
    out.unlink(missing_ok=True)
    tag = f"dlrbench{os.getpid()}"
    leaked: list[str] = []
    t0 = time.perf_counter()
    for phase, restarts in (("save", 1), ("load-storage", 0)):
        job = f"{tag}_{phase.replace('-', '')}"
        try:
            _launch_phase(venv, job, phase, restarts, size_gib, reps, workdir, out, timeout_s)
        finally:
            leaked += _remove_leftovers(job)
    res = json.loads(out.read_text())
    res["leaked"] = leaked
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def _launch_phase(
    venv: Path,
    job: str,
    phase: str,
    restarts: int,
    size_gib: float,
    reps: int,
    workdir: Path,
    out: Path,
    timeout_s: float,
) -> None:
    port = _free_port()
    env = dict(os.environ)
    for k in [k for k in env if k.startswith(("DLROVER_HPC_", "TORCHELASTIC_", "SLURM_"))]:
        del env[k]
    env.update(
        PATH=f"{venv / 'bin'}:{env.get('PATH', '')}",
        DLROVER_MASTER_ADDR=f"127.0.0.1:{port}",
        ELASTIC_JOB_NAME=job,
        PYTHONUNBUFFERED="1",
    )
    master_cmd = [str(venv / "bin/python"), "-m", "dlrover.python.master.main"]
    master_cmd += ["--port", str(port), "--node_num", "1", "--job_name", job]
    master_cmd += ["--platform", "local"]
    run_cmd = [str(venv / "bin/dlrover-run"), "--standalone", "--nnodes=1"]
    run_cmd += ["--nproc_per_node=1", f"--max-restarts={restarts}", __file__, "--phase", phase]
    run_cmd += ["--size-gib", str(size_gib), "--reps", str(reps)]
    run_cmd += ["--ckpt-dir", str(workdir / "ckpt"), "--out", str(out)]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_start(master_cmd, env, workdir / f"{phase}.master.log"))
        _wait_port(port, procs[0], timeout_s=60)
        procs.append(_start(run_cmd, env, workdir / f"{phase}.run.log"))
        try:
            rc = procs[1].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"dlrover-run {phase} ran past {timeout_s} s") from None
        if rc != 0:
            tail = (workdir / f"{phase}.run.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"dlrover-run {phase} exited {rc}:\n{tail}")
    finally:
        for p in reversed(procs):
            _stop_group(p)


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _stop_group(p: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group this launcher started (its own session)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(p.pid, 0)
            except ProcessLookupError:
                p.poll()
                return
            p.poll()
            time.sleep(0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, master: subprocess.Popen, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if master.poll() is not None:
            raise RuntimeError(f"DLRover's master exited {master.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    raise RuntimeError(f"DLRover's master did not listen on port {port} within {timeout_s} s")


def _remove_leftovers(job: str) -> list[str]:
    """Removes this run id's shm segments and socket dir (by exact name); returns them."""
    found = [str(p) for p in Path("/dev/shm").glob(f"{job}_ckpt_shm_*")]
    sock = Path("/tmp/ckpt_sock", job)
    if sock.exists():
        found.append(str(sock))
    for path in found:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with contextlib.suppress(OSError):  # DLRover's parent dir, when nothing else is in it
        sock.parent.rmdir()
    return found


def main() -> None:
    p = argparse.ArgumentParser(description="DLRover 0.6.1 worker (run by dlrover-run)")
    p.add_argument("--phase", choices=("save", "load-storage"), required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True, help="JSON file of the figures (read and extended)")
    worker(p.parse_args())


if __name__ == "__main__":
    main()
