"""A ``dlrover-hpc master`` on 127.0.0.1 for the benchmarks that talk to a real one
(scale.py, rendezvous.py, health_check.py): started as a process, its port read from the
``master.json`` it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def start_master(job_dir: str, token: str, *flags: str) -> tuple[subprocess.Popen[bytes], int]:
    """``dlrover-hpc master --host=127.0.0.1 --port=0 --job-dir=JOB_DIR FLAGS`` with the job
    ``token``; returns the process and its port once it listens (RuntimeError if it exits or
    takes over 60 s)."""
    env = {**os.environ, "DLROVER_HPC_TOKEN": token, "DLROVER_HPC_LOG_LEVEL": "WARNING"}
    master = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrover_hpc.cli.main",
            "master",
            "--host=127.0.0.1",
            "--port=0",
            *flags,
            f"--job-dir={job_dir}",
        ],
        env=env,
    )
    info = Path(job_dir) / "master.json"
    deadline = time.monotonic() + 60
    while not info.exists():
        if time.monotonic() > deadline or master.poll() is not None:
            master.kill()
            raise RuntimeError("the master did not start")
        time.sleep(0.05)
    return master, int(json.loads(info.read_text())["port"])
