"""A restore from the node-local tier (--local-ckpt-dir) against one from the shared tier, in
one run.

One process, its in-process saver, the real /dev/shm: a state of --size-mib is saved as a DISK
step with the local tier set (to --local-dir first, then to --shared-dir), and committed.  Then
--reps times, alternating, a fresh checkpointer (no memory tier: the segments are removed, as
after a requeue) restores it: once with the local tier (source ``local``), once without it
(source ``storage``: the shared directory).  Before each restore the files' pages are dropped
from the page cache (``POSIX_FADV_DONTNEED``), so each read comes from its device, as on a node
that restarted.  Also timed: the persist (save to committed) with the local tier and without
it, which says what the local write adds to the shared persist.  Medians; ``ratio`` is the
shared restore's time over the local one's.

--shared-dir defaults to a second temporary directory (here on the same disk as the local one,
so the ratio is near 1); point it at a network mount (sshfs, NFS) to measure the tier's worth:

    python benchmarks/ckpt_tiers.py --size-mib 256 --reps 5 --shared-dir /mnt/sshfs/ckpt
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dlrover_hpc import environ
from dlrover_hpc.checkpoint import DdpCheckpointer, StorageType
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.saver.local_tier import remove_job_tier
from dlrover_hpc.checkpoint.testing import remove_job_segments


def state_of(size_mib: int, tensors: int = 8) -> dict[str, Any]:
    per = max(1, size_mib * 2**20 // tensors // 4)
    return {"model": {f"w{i}": torch.randn(per) for i in range(tensors)}, "step": 1}


@contextlib.contextmanager
def local_tier(local_dir: str | None) -> Iterator[None]:
    """The local tier as the agent tells its workers (the variable), or none."""
    old = os.environ.pop(environ.LOCAL_CKPT_DIR, None)
    if local_dir:
        os.environ[environ.LOCAL_CKPT_DIR] = local_dir
    try:
        yield
    finally:
        os.environ.pop(environ.LOCAL_CKPT_DIR, None)
        if old is not None:
            os.environ[environ.LOCAL_CKPT_DIR] = old


def drop_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with contextlib.suppress(OSError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def persist_s(shared: Path, local_dir: str | None, env: WorkerEnv, state: dict[str, Any]) -> float:
    """Seconds from a DISK save to its commit (the save's copy to memory included)."""
    with local_tier(local_dir):
        ckpt = DdpCheckpointer(str(shared), env=env, keep_last=1)
        try:
            t0 = time.perf_counter()
            assert ckpt.save_checkpoint(1, state, storage_type=StorageType.DISK)
            assert ckpt.wait_latest_checkpoint(600), f"step 1 not committed in {shared}"
            return time.perf_counter() - t0
        finally:
            ckpt.close(remove_segments=True)


def restore_s(shared: Path, local_dir: str | None, env: WorkerEnv) -> tuple[float, str]:
    with local_tier(local_dir):
        ckpt = DdpCheckpointer(str(shared), env=env)
        try:
            t0 = time.perf_counter()
            state = ckpt.load_checkpoint()
            seconds = time.perf_counter() - t0
            assert state.get("step") == 1 and ckpt.last_restored is not None, ckpt.last_restored
            return seconds, ckpt.last_restored[1]
        finally:
            ckpt.close(remove_segments=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--local-dir", default=None, help="the local tier (default: a temp dir)")
    p.add_argument(
        "--shared-dir",
        default=None,
        help="the shared tier, e.g. an sshfs mount (default: a temp dir)",
    )
    args = p.parse_args()
    job = f"tiers{uuid.uuid4().hex[:8]}"
    env = WorkerEnv.from_environ(
        {"DLROVER_HPC_JOB_ID": job, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    )
    with contextlib.ExitStack() as stack:
        local = args.local_dir or stack.enter_context(tempfile.TemporaryDirectory())
        base = Path(args.shared_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        shared = base / f"ckpt-tiers-{job}"
        plain = base / f"ckpt-plain-{job}"
        try:
            state = state_of(args.size_mib)
            persist_plain = persist_s(plain, None, env, state)
            persist_tiered = persist_s(shared, local, env, state)
            local_t, shared_t, sources = [], [], set()
            for _ in range(args.reps):
                for use_local, times in ((local, local_t), (None, shared_t)):
                    drop_cache(Path(local))
                    drop_cache(shared)
                    seconds, source = restore_s(shared, use_local, env)
                    times.append(seconds)
                    sources.add(source)
        finally:
            remove_job_segments(job)
            remove_job_tier(local, job, env.node_name)
            for d in (shared, plain):
                shutil.rmtree(d, ignore_errors=True)
    assert sources == {"local", "storage"}, sources
    local_med, shared_med = statistics.median(local_t), statistics.median(shared_t)
    print(
        json.dumps(
            {
                "benchmark": "ckpt_tiers",
                "size_mib": args.size_mib,
                "reps": args.reps,
                "local_dir": str(local) if args.local_dir else "(temp)",
                "shared_dir": str(base) if args.shared_dir else "(temp, same disk)",
                "restore_local_s": round(local_med, 4),
                "restore_shared_s": round(shared_med, 4),
                "ratio": round(shared_med / local_med, 3),
                "persist_plain_s": round(persist_plain, 4),
                "persist_tiered_s": round(persist_tiered, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
