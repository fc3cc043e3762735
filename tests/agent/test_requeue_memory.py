"""An agent ended by a requeue keeps the node's segments; stale ones of finished jobs go.
The Slurm answers are lines captured verbatim from the local Slurm (tests/data/slurm)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from dlrover_hpc.agent.requeue_memory import keep_for_requeue, stale_segments, sweep_stale
from dlrover_hpc.checkpoint.env import current_user, segment_prefix
from dlrover_hpc.slurm.commands import Completed

DATA = Path(__file__).parents[1] / "data" / "slurm"


class Slurm:
    """Answers ``scontrol show job`` with a captured line and ``squeue --me`` with ids."""

    def __init__(self, show: str = "", jobs: Sequence[str] = (), rc: int = 0) -> None:
        self.show, self.jobs, self.rc = show, jobs, rc
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> Completed:
        self.calls.append(tuple(argv))
        out = self.show if argv[0] == "scontrol" else "".join(f"{j}\n" for j in self.jobs)
        err = "slurm_load_jobs error: Unable to contact slurm controller" if self.rc else ""
        return Completed(argv=tuple(argv), returncode=self.rc, stdout=out, stderr=err)


def _line(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.parametrize(
    ("env", "answer", "rc", "keep"),
    [
        ({"SLURM_JOB_ID": "6100001"}, "show_job_requeued_completing.txt", 0, True),
        (
            {"SLURM_JOB_ID": "6100001", "SLURM_RESTART_COUNT": "1"},
            "show_job_requeued_completing.txt",
            0,
            False,
        ),
        ({"SLURM_JOB_ID": "6100001"}, "show_job_batch_host_lost.txt", 0, False),
        ({"SLURM_JOB_ID": "2"}, "show_job_completed.txt", 0, False),
        ({"SLURM_JOB_ID": "6100001"}, "show_job_requeued_completing.txt", 1, False),  # no answer
        ({}, "show_job_requeued_completing.txt", 0, False),  # not under Slurm: never asked
    ],
)
def test_keep_for_requeue(env: dict[str, str], answer: str, rc: int, keep: bool) -> None:
    slurm = Slurm(show=_line(answer), rc=rc)
    assert keep_for_requeue(env, run=slurm) is keep
    if env:
        assert slurm.calls == [("scontrol", "-o", "show", "job", env["SLURM_JOB_ID"])]
    else:
        assert slurm.calls == []


def test_keep_for_requeue_asks_slurm_nothing_without_segments() -> None:
    slurm = Slurm(show=_line("show_job_requeued_completing.txt"))
    assert keep_for_requeue({"SLURM_JOB_ID": "6100001"}, segments=False, run=slurm) is False
    assert slurm.calls == []


def _name(user: str, job: str, rest: str = "r0-a") -> str:
    return segment_prefix(user=user, job_id=job, node_name="node2") + rest


@pytest.mark.parametrize(
    ("names", "live", "stale"),
    [
        ([_name("alice", "7"), _name("alice", "8", "cr1-b")], {"8"}, [_name("alice", "7")]),
        ([_name("alice", "7"), _name("alice", "8")], {"7", "8"}, []),
        ([_name("bob", "7")], set(), []),  # another user's
        ([_name("alice", "standalone-123")], set(), []),  # not a Slurm job
        (
            [_name("alice", "7", "a23327-0.progress")],
            set(),
            [_name("alice", "7", "a23327-0.progress")],
        ),
        (["torch_123", "dlrover-hpc-alice"], set(), []),
    ],
)
def test_stale_segments(names: list[str], live: set[str], stale: list[str]) -> None:
    assert stale_segments(names, user="alice", live_jobs=live) == stale


def test_sweep_stale_removes_only_unlisted_jobs(tmp_path: Path) -> None:
    me = current_user()
    for job in ("41", "42", "43"):
        (tmp_path / _name(me, job)).write_bytes(b"x")
    (tmp_path / "other").write_bytes(b"x")
    slurm = Slurm(jobs=["42"])
    removed = sweep_stale({"SLURM_JOB_ID": "43"}, shm_dir=str(tmp_path), run=slurm)
    assert removed == [_name(me, "41")]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [_name(me, "42"), _name(me, "43"), "other"]
    )
    assert slurm.calls == [("squeue", "-h", "--me", "-o", "%A")]


def test_sweep_stale_asks_slurm_nothing_on_a_clean_node(tmp_path: Path) -> None:
    (tmp_path / _name(current_user(), "43")).write_bytes(b"x")  # the running job's own
    (tmp_path / _name("somebody_else", "41")).write_bytes(b"x")
    slurm = Slurm(jobs=[])
    assert sweep_stale({"SLURM_JOB_ID": "43"}, shm_dir=str(tmp_path), run=slurm) == []
    assert slurm.calls == [] and len(list(tmp_path.iterdir())) == 2


def test_sweep_stale_removes_nothing_when_slurm_does_not_answer(tmp_path: Path) -> None:
    (tmp_path / _name(current_user(), "41")).write_bytes(b"x")
    assert sweep_stale({"SLURM_JOB_ID": "43"}, shm_dir=str(tmp_path), run=Slurm(rc=1)) == []
    assert sweep_stale({}, shm_dir=str(tmp_path), run=Slurm()) == []
    assert len(list(tmp_path.iterdir())) == 1
