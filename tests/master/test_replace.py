"""Replacement requests: what sbatch is asked for, and Slurm's refusal read from its output
(captured from the local Slurm: tests/data/slurm/sbatch_refused_exclude.txt)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.master.replace import Replacer, sbatch_refusal
from dlrover_hpc.slurm.commands import Completed, Runner

REFUSED = (Path(__file__).parents[1] / "data" / "slurm" / "sbatch_refused_exclude.txt").read_text()


class Slurm:
    """Answers squeue and sbatch with recorded output, and keeps the argv it was given."""

    def __init__(
        self, *, sbatch_rc: int, sbatch_out: str = "", sbatch_err: str = "", state: str = "RUNNING"
    ) -> None:
        self.calls: list[list[str]] = []
        self.sbatch = (sbatch_rc, sbatch_out, sbatch_err)
        self.state = state

    def __call__(self, argv: Sequence[str], *, timeout_s: float) -> Completed:
        self.calls.append(list(argv))
        if argv[0] == "squeue":
            out = f"{self.state} node[1-2,5]\n" if self.state else ""  # "": a job ended
            return Completed(argv=tuple(argv), returncode=0, stdout=out, stderr="")
        rc, out, err = self.sbatch
        return Completed(argv=tuple(argv), returncode=rc, stdout=out, stderr=err)


def _replacer(tmp_path: Path, slurm: Runner) -> Replacer:
    return Replacer(
        job_id="12",
        job_dir=tmp_path,
        template="sbatch/replacement.sbatch",
        master_addr="node1:4000",
        events=EventLog(tmp_path / "events.jsonl"),
        run=slurm,
    )


def test_request_avoids_faulty_nodes_and_the_jobs_allocation(tmp_path: Path) -> None:
    slurm = Slurm(sbatch_rc=0, sbatch_out="77\n")
    assert _replacer(tmp_path, slurm).request(2, ["node3", "node1"]) is None
    squeue, sbatch = slurm.calls
    assert squeue == ["squeue", "-h", "-j", "12", "-o", "%T %N"]
    assert "-N2" in sbatch and "--exclude=node[1-3,5]" in sbatch
    assert "--no-requeue" in sbatch  # the master asks again itself (Slurm's requeue drained nodes)
    (event,) = map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
    assert event["event"] == "replacement_requested" and event["job"] == "77"
    assert event["exclude"] == ["node1", "node2", "node3", "node5"]


def test_a_refusal_comes_back_with_slurms_reason(tmp_path: Path) -> None:
    slurm = Slurm(sbatch_rc=1, sbatch_err=REFUSED)
    reason = _replacer(tmp_path, slurm).request(1, [])
    assert reason == "Requested node configuration is not available"
    assert not (tmp_path / "events.jsonl").exists()  # the master reports replacement_failed


def test_squeue_failing_is_a_refusal_too(tmp_path: Path) -> None:
    def broken(argv: Sequence[str], *, timeout_s: float) -> Completed:
        return Completed(argv=tuple(argv), returncode=1, stdout="", stderr="slurm_load_jobs error")

    reason = _replacer(tmp_path, broken).request(1, [])
    assert reason == "SlurmError: squeue -j 12 failed: slurm_load_jobs error"


@pytest.mark.parametrize(
    "stderr,reason",
    [
        (REFUSED, "Requested node configuration is not available"),
        (
            "sbatch: error: Batch job submission failed: Invalid account or account/partition "
            "combination specified\n",
            "Invalid account or account/partition combination specified",
        ),
        (
            "sbatch: fatal: Could not establish a configuration source\n",
            "sbatch: fatal: Could not establish a configuration source",
        ),
        ("", ""),
    ],
)
def test_sbatch_refusal(stderr: str, reason: str) -> None:
    assert sbatch_refusal(stderr) == reason


def test_a_job_being_cancelled_asks_for_no_replacement(tmp_path: Path) -> None:
    # scancel ends the agents first: the master saw every node lost and submitted a replacement
    # job that outlived the cancelled job (a leak of the fail-slow test)
    slurm = Slurm(sbatch_rc=0, sbatch_out="77\n", state="CANCELLED")
    assert _replacer(tmp_path, slurm).request(3, []) == "the job is CANCELLED"
    assert [c[0] for c in slurm.calls] == ["squeue"]  # no sbatch
    assert not (tmp_path / "events.jsonl").exists()
    # Once cancelled, `squeue -j` prints nothing (captured from the local Slurm)
    gone = Slurm(sbatch_rc=0, sbatch_out="77\n", state="")
    assert _replacer(tmp_path, gone).request(3, []) == "the job is gone"
    assert [c[0] for c in gone.calls] == ["squeue"]
