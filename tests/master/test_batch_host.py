"""At the job's end the master cancels a job whose batch host died (Slurm kept it RUNNING
without its job script); any other job it leaves alone.  Slurm's answers are lines captured
verbatim from the local Slurm (tests/data/slurm)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc.master.batch_host import end_orphaned_job
from dlrover_hpc.slurm.commands import Completed

DATA = Path(__file__).parents[1] / "data" / "slurm"


class Slurm:
    def __init__(self, show: str, *, rc: int = 0, scancel_rc: int = 0) -> None:
        self.show, self.rc, self.scancel_rc = show, rc, scancel_rc
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> Completed:
        self.calls.append(tuple(argv))
        rc = self.rc if argv[0] == "scontrol" else self.scancel_rc
        out = self.show if argv[0] == "scontrol" else ""
        err = (
            "scancel: error: Kill job error on job id 6100001: Access/permission denied"
            if rc
            else ""
        )
        return Completed(argv=tuple(argv), returncode=rc, stdout=out, stderr=err)


@pytest.mark.parametrize(
    ("answer", "env", "rc", "scancel_rc", "calls", "cancelled", "emitted"),
    [
        ("show_job_batch_host_lost.txt", "6100001", 0, 0, ["scontrol", "scancel"], True, True),
        ("show_job_batch_host_lost.txt", "6100001", 0, 1, ["scontrol", "scancel"], False, True),
        ("show_job_batch_host_lost.txt", "6100001", 1, 0, ["scontrol"], False, False),
        ("show_job_batch_host_lost.txt", None, 0, 0, [], False, False),  # not this job's master
        ("show_job_requeued_completing.txt", "6100001", 0, 0, ["scontrol"], False, False),
        ("show_job_completed.txt", "6100001", 0, 0, ["scontrol"], False, False),
    ],
)
def test_end_orphaned_job(
    answer: str,
    env: str | None,
    rc: int,
    scancel_rc: int,
    calls: list[str],
    cancelled: bool,
    emitted: bool,
) -> None:
    slurm = Slurm((DATA / answer).read_text(), rc=rc, scancel_rc=scancel_rc)
    events: list[tuple[Any, dict[str, Any]]] = []
    done = end_orphaned_job(
        "6100001",
        exit_code=0,
        emit=lambda name, **fields: events.append((name, fields)),
        environ={"SLURM_JOB_ID": env} if env else {},
        run=slurm,
    )
    assert done is cancelled
    assert [c[0] for c in slurm.calls] == calls
    if "scancel" in calls:
        assert slurm.calls[-1] == ("scancel", "6100001")
    expected = [("batch_host_lost", {"node": "node1", "job": "6100001", "exit_code": 0})]
    assert events == (expected if emitted else [])
