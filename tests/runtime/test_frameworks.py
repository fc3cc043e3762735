"""The framework matrix (issue 27, item 5) on the real local Slurm: each framework's usual
script (examples/frameworks/) started by train.sbatch as `dlrover-run` (torchrun's flags), 2
nodes x 2 processes, rank 3 (on the second node) SIGKILLed before step 16 of 30.  With the
framework's own checkpoints (every 10 steps) the job resumes at step 10, losing 5 steps; with
our flash checkpoint (memory every step) at step 15, losing none.  Lightning runs twice: the
current release and 2.1 (`pytorch_lightning`, which picks its SLURM environment from
SLURM_NTASKS and SLURM_PROCID: the workers' values must be theirs, not the agent's).  DeepSpeed
runs ZeRO stage 1 on the CPU (gloo, torch's AdamW: no op built).  The jobs run side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from runtime_helpers import REPO, events, named, sbatch, wait_job

from dlrover_hpc.testing import LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]
EXAMPLES = REPO / "examples" / "frameworks"
PL21 = REPO / ".venv" / "pl21"  # Lightning 2.1, installed beside the current one (Makefile)
#: the pre-warmed interpreter imports the framework once per node, not once per worker start
HF = {"DLROVER_HPC_PRELOAD": "transformers"}
PL = {"DLROVER_HPC_PRELOAD": "lightning.pytorch"}
OLD = {"PYTHONPATH": str(PL21), "DLROVER_HPC_PRELOAD": "pytorch_lightning"}
ACC = {"DLROVER_HPC_PRELOAD": "accelerate"}
DS = {"DLROVER_HPC_PRELOAD": "deepspeed"}
STEPS, SAVE, KILL = 30, 10, 15

#: name -> (script, extra arguments, environment, flash)
MATRIX: dict[str, tuple[str, list[str], dict[str, str], bool]] = {
    "hf-own": ("hf_trainer.py", [], HF, False),
    "hf-flash": ("hf_trainer.py", ["--flash"], HF, True),
    "lightning-own": ("lightning_train.py", [], PL, False),
    "lightning-flash": ("lightning_train.py", ["--flash"], PL, True),
    "lightning21-own": ("lightning_train.py", ["--pytorch-lightning"], OLD, False),
    "lightning21-flash": ("lightning_train.py", ["--pytorch-lightning", "--flash"], OLD, True),
    "accelerate-own": ("accelerate_train.py", [], ACC, False),
    "accelerate-flash": ("accelerate_train.py", ["--flash"], ACC, True),
    "deepspeed-own": ("deepspeed_train.py", [], DS, False),
    "deepspeed-flash": ("deepspeed_train.py", ["--flash"], DS, True),
}  # fmt: skip


def test_frameworks_run_unchanged_recover_and_lose_no_step_with_flash(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    if not (PL21 / "pytorch_lightning").is_dir():
        pytest.fail(f"Lightning 2.1 is not installed at {PL21} (make venv installs it)")
    jobs = {}
    for name, (script, extra, env, _) in MATRIX.items():
        out = shared_tmp / name
        out.mkdir()
        argv = [str(EXAMPLES / script), "--out", str(out), *extra]
        argv += ["--max-steps", str(STEPS), "--save-steps", str(SAVE)]
        argv += ["--kill-at-step", str(KILL), "--kill-rank", "3"]
        jobs[name] = sbatch(
            out, 2, "--nnodes=2", "--nproc-per-node=2", *argv, env={"OMP_NUM_THREADS": "1", **env}
        )
    table = {}
    for name, job in jobs.items():
        out = shared_tmp / name
        fields = wait_job(job, timeout_s=600)
        log = (out / f"slurm-{job}.out").read_text()
        assert fields["JobState"] == "COMPLETED", (name, log[-4000:])
        evs = events(out / ".dlrover-hpc" / job)
        failed = [e for e in named(evs, "worker_failed") if e["classification"] != "peer"]
        assert [(e["rank"], e["signal"]) for e in failed] == [(3, "SIGKILL")], (name, failed)
        runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
        begins = [r for r in runs if r["event"] == "begin"]
        ends = [r for r in runs if r["event"] == "end"]
        assert [b["restart"] for b in begins] == [0, 1], (name, runs)
        assert begins[0]["step"] == 0 and [e["step"] for e in ends] == [STEPS], (name, runs)
        assert all(r.get("world", 4) == 4 for r in runs), (name, runs)
        flash = MATRIX[name][3]
        resumed = begins[1]["step"]
        table[name] = {"resumed_at": resumed, "lost": KILL - resumed}
        assert resumed == (KILL if flash else KILL - KILL % SAVE), (name, runs)
    print(json.dumps({"framework_matrix": table}))
