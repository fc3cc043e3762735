"""Megatron-Core on an NVIDIA GPU (issue 27): its distributed checkpoints
(`megatron.core.dist_checkpointing`) through the flash path, under `dlrover-run --standalone`,
the process SIGKILLed after step 15 of 30, checkpoints every 10 steps: Megatron's own
checkpoints resume at 10, the flash path at 15 (restored from memory).  This test runs the
script on a CUDA GPU only (it also takes --cpu, but the CPU matrix does not install
Megatron-Core), so CPU runs skip it; on an H100 it passed (docs/guide/frameworks.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import REPO, run_env

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None, reason="needs megatron-core installed"
    ),
]


@pytest.mark.parametrize(("flash", "resumed"), [(True, 15), (False, 10)])
def test_megatron_core_resumes_at_the_newest_step(
    tmp_path: Path, flash: bool, resumed: int
) -> None:
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "dlrover_hpc.cli.run", "--standalone", "--nproc-per-node=1"]
    argv += [str(REPO / "examples" / "frameworks" / "megatron_train.py"), "--out", str(out)]
    argv += ["--kill-at-step", "15", *(["--flash"] if flash else [])]
    done = subprocess.run(
        argv, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["restart"], r["event"], r["step"]) for r in runs] == [
        (0, "begin", 0),
        (1, "begin", resumed),
        (1, "end", 30),
    ], runs
