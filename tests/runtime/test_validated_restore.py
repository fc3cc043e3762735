"""A poisoned step is never trained on: dlrover-run --standalone, two real torch ranks (gloo).

The script saves a state holding a NaN at step 14 and its rank 0 SIGKILLs itself right after;
the agent persists that step (the newest in memory) before the restart.  After the restart
every rank rejects step 14, restores step 12 from the node's second shared-memory buffer (it
is newer than storage's step 10), step 14 is taken out of storage's commits, and the job
completes.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from runtime_helpers import BIN, TRAIN, events, named

pytestmark = [pytest.mark.timeout(240), pytest.mark.runtime]

FLASH = TRAIN.parent / "train_flash_ckpt.py"


def test_a_poisoned_step_is_rejected_and_the_older_step_restored(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            f"--job-dir={tmp_path / 'job'}",
            str(FLASH),
            "--steps=24",
            f"--ckpt-dir={tmp_path / 'ck'}",
            "--save-every=2",
            "--persist-every=10",
            "--keep-last=3",
            "--poison-at-step=14",
            "--fail-at-step=14",
            "--fail-rank=0",
            f"--result={result}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(result.read_text())
    assert summary["restored"] == [12, "memory"], summary
    assert summary["final_step"] == 24 and summary["restart_count"] == 1
    evs = events(tmp_path / "job")
    # the poisoned step (and 12) were persisted when the worker died: storage held it too
    persisted = [e["step"] for e in named(evs, "checkpoint_persisted") if e.get("committed")]
    assert persisted[0] == 10 and sorted(persisted[1:3]) == [12, 14]
    rejected = named(evs, "restore_rejected")
    assert [(e["step"], e["source"], e["next_step"], e["next_source"]) for e in rejected] == [
        (14, "memory", 12, "memory")
    ]
    assert rejected[0]["why"].startswith("non-finite values in model.0.weight (1 of 2048: nan)")
    restored = named(evs, "checkpoint_restored")
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == [
        (0, 12, "memory"),
        (1, 12, "memory"),
    ]
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    # the agent persisted 14 and 12 (the two newest in memory) before the restart; step 14 is
    # no longer committed (its record renamed, its file kept), so retention (keep_last=3)
    # keeps 12, 20 and 24; the job trained on from step 12 to a finite end
    commits = sorted(p.name for p in (tmp_path / "ck" / ".dlrover-hpc" / "commits").iterdir())
    assert commits == [
        "step-000000000012.json",
        "step-000000000014.json.rejected",
        "step-000000000020.json",
        "step-000000000024.json",
    ]
    assert (tmp_path / "ck" / "checkpoint-14.pt").exists()
    latest = (tmp_path / "ck" / "dlrover_latest.txt").read_text().strip()
    assert latest == "24"
    final = torch.load(tmp_path / "ck" / "checkpoint-24.pt", weights_only=False)
    assert all(math.isfinite(float(v.abs().sum())) for v in final["model"].values())
    assert "restore_rejected" in proc.stderr + proc.stdout
