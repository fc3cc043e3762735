"""dlrover-run --standalone: real torch workers (gloo), real SIGKILL, no Slurm."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from runtime_helpers import BIN, TRAIN, events, named


def _run(tmp_path: Path, *args: str, nproc: int = 2, max_restarts: int = 3):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            f"--job-dir={tmp_path / 'job'}",
            str(TRAIN),
            *args,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_standalone_survives_sigkilled_worker_every_time(tmp_path: Path) -> None:
    """torchrun (gloo) cannot recover from this; we restart with a fresh store per round."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    result = tmp_path / "result.json"
    proc = _run(
        tmp_path,
        "--steps=16",
        f"--ckpt-dir={ckpt}",
        "--ckpt-every=4",
        "--fail-at-step=10",
        "--fail-rank=1",
        f"--result={result}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary == {"final_step": 16, "world_size": 2, "restart_count": 1, "group_world_size": 1}
    evs = events(tmp_path / "job")
    failed = named(evs, "worker_failed")
    assert len(failed) == 1
    assert failed[0]["rank"] == 1 and failed[0]["signal"] == "SIGKILL"
    assert [e["restart_count"] for e in named(evs, "workers_restarted")] == [1]
    assert named(evs, "job_finished")[-1]["exit_code"] == 0
    # Resumed from the step-8 checkpoint, not from scratch: steps 9.. ran twice at most.
    assert "step 9 loss" in proc.stdout and "restart 1" in proc.stdout


def test_restart_budget_is_per_job_and_exit_code_reflects_workers(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['LOCAL_RANK'] == '0' else 0)\n")
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            # 1: a second failure spends it; a third round failed the same way without progress
            # would end the job as a crash loop first (exit 3, --crash-loop-rounds)
            "--max-restarts=1",
            f"--job-dir={tmp_path / 'job'}",
            str(bad),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    evs = events(tmp_path / "job")
    assert len(named(evs, "worker_failed")) == 2  # first run + 1 restart
    assert [e["exit_code"] for e in named(evs, "worker_failed")] == [3, 3]
    assert named(evs, "job_finished")[-1]["exit_code"] == 1
    assert "restarts are used up" in named(evs, "job_finished")[-1]["reason"]


def test_torchrun_environment_is_complete(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text(
        "import json, os\n"
        "keys = ['RANK','LOCAL_RANK','WORLD_SIZE','LOCAL_WORLD_SIZE','GROUP_RANK',"
        "'GROUP_WORLD_SIZE','ROLE_RANK','ROLE_WORLD_SIZE','MASTER_ADDR','MASTER_PORT',"
        "'TORCHELASTIC_RESTART_COUNT','TORCHELASTIC_MAX_RESTARTS','TORCHELASTIC_RUN_ID',"
        "'DLROVER_HPC_MASTER','DLROVER_HPC_JOB_DIR']\n"
        "out = {k: os.environ.get(k) for k in keys}\n"
        "open(f'env-{os.environ[\"RANK\"]}.json', 'w').write(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc_per_node=2",
            "--max_restarts=4",
            "--rdzv-id=myrun",
            f"--job-dir={tmp_path / 'job'}",
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for rank in (0, 1):
        env = json.loads((tmp_path / f"env-{rank}.json").read_text())
        assert all(v is not None for v in env.values()), env
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "4"
        assert env["TORCHELASTIC_RUN_ID"] == "myrun"
        assert env["DLROVER_HPC_JOB_DIR"] == str(tmp_path / "job")


def test_log_dir_and_redirects_write_per_rank_logs(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            "--redirects=3",
            f"--log-dir={tmp_path / 'logs'}",
            f"--job-dir={tmp_path / 'job'}",
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outs = sorted((tmp_path / "logs").rglob("stdout.log"))
    assert len(outs) == 2
    assert sorted(p.read_text().strip() for p in outs) == ["hello from 0", "hello from 1"]
    assert "hello from" not in proc.stdout  # redirected, not on the console


FLASH = TRAIN.parent / "train_flash_ckpt.py"


def test_flash_checkpoint_survives_sigkill_by_restoring_from_memory(tmp_path: Path) -> None:
    """The agent's saver persists the newest memory step of the dead worker's job, and the
    restarted workers restore from /dev/shm, not from disk."""
    result = tmp_path / "result.json"
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            f"--job-dir={tmp_path / 'job'}",
            str(FLASH),
            "--steps=24",
            f"--ckpt-dir={tmp_path / 'ck'}",
            "--save-every=2",
            "--persist-every=10",
            "--fail-at-step=15",
            "--fail-rank=1",
            f"--result={result}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary["restored"] == [14, "memory"] and summary["final_step"] == 24
    evs = events(tmp_path / "job")
    restored = named(evs, "checkpoint_restored")
    assert sorted((e["rank"], e["step"], e["source"]) for e in restored) == [
        (0, 14, "memory"),
        (1, 14, "memory"),
    ]
    persisted = [e["step"] for e in named(evs, "checkpoint_persisted") if e["committed"]]
    assert 14 in persisted  # persisted on failure, before the restart
    assert persisted[-1] == 24
    # Plain torch.load reads a persisted checkpoint (no lock-in).
    import torch

    latest = (tmp_path / "ck" / "dlrover_latest.txt").read_text().strip()
    assert latest == "24"
    state = torch.load(tmp_path / "ck" / "checkpoint-24.pt", weights_only=False)
    assert isinstance(state, dict) and state
