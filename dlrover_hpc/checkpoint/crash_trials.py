"""Crash injection for the saver: persist in a child process and SIGKILL it at random points.

The parent holds a two-rank job's segments (written by real `RankCheckpointer`s that never
persist), runs a fresh saver process per trial to persist the newest step, kills it at a chosen
fault point or after a random delay, and then checks, by loading from storage like a restarted
job would, that the step it gets is the newest committed one and that every rank's part is
exactly what that step saved: never torn, never mixed.

Run the saver side alone: `python -m dlrover_hpc.checkpoint.crash_trials SEGMENT... --step N`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from dlrover_hpc import environ
from dlrover_hpc.checkpoint.saver.commit_records import CheckpointDir
from dlrover_hpc.checkpoint.saver.commits import CommitCounter
from dlrover_hpc.checkpoint.saver.persist_queue import SaverCore
from dlrover_hpc.checkpoint.saver.storage import Storage

_KILL_ENV = environ.CRASH_KILL_AT


class _KillAt:
    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self, point: str) -> None:
        self.seen += 1
        if self.seen == self.n:
            os.kill(os.getpid(), signal.SIGKILL)


class _Count:
    def __init__(self) -> None:
        self.seen = 0
        self.commit_at = 0  # the point right after the commit record is on storage

    def __call__(self, point: str) -> None:
        self.seen += 1
        if point == "commit:recorded" and not self.commit_at:
            self.commit_at = self.seen


def saver_main(argv: list[str] | None = None) -> int:
    """The child: persist `--step` from the given segments, then exit 0."""
    p = argparse.ArgumentParser(prog="python -m dlrover_hpc.checkpoint.crash_trials")
    p.add_argument("segments", nargs="+")
    p.add_argument("--step", type=int, required=True)
    p.add_argument("--kill-at", type=int, default=int(os.environ.get(_KILL_ENV, "0")))
    p.add_argument(
        "--count",
        action="store_true",
        help="print the number of fault points and the one right after the commit",
    )
    args = p.parse_args(argv)
    counter = _Count()
    fault: Any = _KillAt(args.kill_at) if args.kill_at > 0 else counter
    core = SaverCore(commit=CommitCounter(), fault=fault, io_threads=2)
    core.start()
    for path in args.segments:
        core.submit(path, step=args.step)
    ok = core.wait_idle(120)
    core.close()
    if args.count:
        print(counter.seen, counter.commit_at, flush=True)
    return 0 if ok else 1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Trial:
    step: int
    kill_at: int  # 0: no kill point
    kill_after_s: float | None
    exit_code: int
    loaded: int | None
    newest_record: int | None


class Harness:
    """A two-rank job in one process whose persists run (and die) in child processes."""

    def __init__(self, root: Path, *, job_id: str, numel: int = 1 << 16, keep_last: int = 2):
        from dlrover_hpc.checkpoint.env import WorkerEnv
        from dlrover_hpc.checkpoint.testing import NullLink
        from dlrover_hpc.checkpoint.trainer.torchfile_checkpointer import RankCheckpointer

        self.root = root
        self.ckpt_dir = str(root / "ckpt")
        self.numel = numel
        self.step = 0
        self.ckpts = []
        self.links = []
        for rank in range(2):
            env = WorkerEnv.from_environ(
                {
                    environ.JOB_ID: job_id,
                    "RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2",
                }
            )
            link = NullLink(env.prefix, env.shm_dir)
            self.links.append(link)
            self.ckpts.append(
                RankCheckpointer(self.ckpt_dir, env=env, link=link, keep_last=keep_last)
            )
        self.points = 0
        self.commit_at = 0

    def save_next(self) -> tuple[int, list[str]]:
        """Every rank saves the next step (DISK); returns it and the segments holding it."""
        from dlrover_hpc.checkpoint.api import StorageType
        from dlrover_hpc.checkpoint.testing import filled_state

        self.step += 1
        paths = []
        for rank, ckpt in enumerate(self.ckpts):
            state = filled_state(self.step * 10 + rank, numel=self.numel)
            assert ckpt.save_checkpoint(self.step, state, storage_type=StorageType.DISK)
            paths.append(self.links[rank].submitted[-1][0])
        return self.step, paths

    def _child(self, paths: list[str], step: int, *extra: str) -> subprocess.Popen[str]:
        cmd = [
            sys.executable,
            "-m",
            "dlrover_hpc.checkpoint.crash_trials",
            *paths,
            "--step",
            str(step),
        ]
        return subprocess.Popen([*cmd, *extra], stdout=subprocess.PIPE, text=True)

    def count_points(self) -> int:
        """Fault points of one full persist + commit + retention (a clean dry run), and the
        point right after the commit record."""
        step, paths = self.save_next()
        proc = self._child(paths, step, "--count")
        out, _ = proc.communicate(timeout=120)
        points, commit_at = out.strip().splitlines()[-1].split()
        self.points, self.commit_at = int(points), int(commit_at)
        return self.points

    def trial(self, rng: random.Random, *, timed: bool = False, committed: bool = False) -> Trial:
        """Kill the persist at a random point (``committed``: one at or after the commit
        record), or with ``timed`` after a random delay."""
        step, paths = self.save_next()
        kill_at, delay = 0, None
        if timed:
            delay = rng.uniform(0.0, 0.25)
        elif committed and self.commit_at:
            kill_at = rng.randint(self.commit_at, self.points)
        else:
            kill_at = rng.randint(1, self.points + 2)  # a few trials run to the end
        proc = self._child(paths, step, "--kill-at", str(kill_at))
        if delay is not None:
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=120)
        loaded, newest = self.verify()
        return Trial(
            step=step,
            kill_at=kill_at,
            kill_after_s=delay,
            exit_code=proc.returncode,
            loaded=loaded,
            newest_record=newest,
        )

    def verify(self) -> tuple[int | None, int | None]:
        """Loads like a restarted job (storage only) and checks what it got."""
        from dlrover_hpc.checkpoint.testing import check_filled

        cdir = CheckpointDir(self.ckpt_dir, Storage(self.ckpt_dir))
        newest = cdir.newest_step()
        tracker = cdir.tracker_step()  # always parses: replaced atomically
        assert tracker is None or newest is not None, "tracker names a step with no record"
        steps: list[int | None] = []
        for rank, ckpt in enumerate(self.ckpts):
            state = ckpt.load_checkpoint(memory=False)
            if not state:
                steps.append(None)
                continue
            step = int(state["step"]) // 10
            check_filled(state, step * 10 + rank)  # not torn, not from another save
            steps.append(step)
        assert steps[0] == steps[1], f"ranks loaded different steps {steps}"
        assert steps[0] == newest, f"loaded step {steps[0]} but the newest committed is {newest}"
        return steps[0], newest

    def close(self) -> None:
        for ckpt in self.ckpts:
            ckpt.close(remove_segments=True)


def run_trials(
    root: Path, *, trials: int, seed: int, job_id: str, timed_every: int = 4
) -> list[Trial]:
    """`trials` crash trials: every `timed_every`-th one killed after a random delay, the one
    half-way between two of those at a point after the commit record (only 10 of about 90
    points come after it: uniform points alone missed them all in one run of 50, cc28), the
    others at a uniformly chosen point."""
    rng = random.Random(seed)
    harness = Harness(root, job_id=job_id)
    try:
        harness.count_points()
        out = []
        for i in range(trials):
            timed = timed_every > 0 and i % timed_every == 0
            committed = timed_every > 1 and i % timed_every == timed_every // 2
            out.append(harness.trial(rng, timed=timed, committed=committed))
        return out
    finally:
        harness.close()


if __name__ == "__main__":
    sys.exit(saver_main())
