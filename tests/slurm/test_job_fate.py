"""What ``scontrol -o show job`` says of a job whose node died, on lines captured verbatim from
the local Slurm 22.05 (tests/runtime/test_batch_host.py prints them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_hpc.slurm.job_fate import batch_host_lost, requeued
from dlrover_hpc.slurm.parse import parse_oneliner

DATA = Path(__file__).parents[1] / "data" / "slurm"


def _job(name: str, **changed: str) -> dict[str, str]:
    fields = parse_oneliner((DATA / name).read_text())
    fields.update(changed)
    return fields


#: the batch host (node1) of a --no-kill job killed: RUNNING on node[2-3], no job script
KEPT = "show_job_batch_host_lost.txt"
#: the batch host of a job without --no-kill killed: requeued at once, its processes ending
REQUEUED = "show_job_requeued_completing.txt"
#: a job that ended normally
COMPLETED = "show_job_completed.txt"


@pytest.mark.parametrize(
    ("name", "changed", "restart_count", "expected"),
    [
        (REQUEUED, {}, 0, True),  # the first run's agents, at their SIGTERM
        (REQUEUED, {"JobState": "PENDING", "Reason": "BeginTime"}, 0, True),
        (REQUEUED, {"JobState": "REQUEUE_HOLD"}, 0, True),
        (REQUEUED, {}, 1, False),  # the requeued run's agents: not requeued since
        (REQUEUED, {"Restarts": "3"}, 1, True),
        (REQUEUED, {"JobState": "CANCELLED"}, 0, False),  # scancel after the requeue
        (REQUEUED, {"JobState": "NODE_FAIL"}, 0, False),
        (REQUEUED, {"Restarts": "x"}, 0, False),
        (COMPLETED, {}, 0, False),
        (COMPLETED, {"JobState": "COMPLETING"}, 0, False),  # an ordinary end
        (KEPT, {}, 0, False),  # --no-kill: Slurm kept the job running
    ],
)
def test_requeued(name: str, changed: dict[str, str], restart_count: int, expected: bool) -> None:
    assert requeued(_job(name, **changed), restart_count=restart_count) is expected


@pytest.mark.parametrize(
    ("name", "changed", "expected"),
    [
        (KEPT, {}, "node1"),
        (KEPT, {"NodeList": "node[1-3]"}, None),  # the batch host is alive
        (KEPT, {"JobState": "COMPLETING"}, None),
        (REQUEUED, {}, None),  # requeued: Slurm ends it, the next run has a batch script
        (COMPLETED, {}, None),
        (KEPT, {"BatchHost": "(null)"}, None),
        (KEPT, {"BatchFlag": "0"}, None),  # an allocation (salloc): no job script to lose
        (KEPT, {"NodeList": "node[2-"}, None),  # not a host list: no verdict
    ],
)
def test_batch_host_lost(name: str, changed: dict[str, str], expected: str | None) -> None:
    assert batch_host_lost(_job(name, **changed)) == expected
