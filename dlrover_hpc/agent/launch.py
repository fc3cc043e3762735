"""``dlrover-run``: find (or start) the master, then run the node's agent."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from pathlib import Path

from dlrover_hpc.agent.agent import Agent
from dlrover_hpc.config import MasterConfig, NodeRange, RunConfig, parse_host_port
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.jobdir import default_job_dir, make_job_dir
from dlrover_hpc.master.server import MasterThread, resolve_token

log = logging.getLogger(__name__)

MASTER_WAIT_S = 120.0


def find_master(job_dir: Path, *, timeout_s: float = MASTER_WAIT_S) -> tuple[str, int]:
    """``master.json`` in the job directory, written by the master step once it listens."""
    path = job_dir / "master.json"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = json.loads(path.read_text())
            return str(info["host"]), int(info["port"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"no job master found: {path} did not appear within {timeout_s:.0f} s; "
                    "start 'dlrover-hpc master' first (the sbatch templates do), or pass "
                    "--master HOST:PORT / set DLROVER_HPC_MASTER"
                ) from None
            time.sleep(0.2)


def run_agent(config: RunConfig) -> int:
    if config.standalone:
        return _run_standalone(config)
    job_dir = make_job_dir(config.job_dir or default_job_dir())
    master = config.master
    if master is None and os.environ.get("DLROVER_HPC_MASTER"):
        master = parse_host_port(os.environ["DLROVER_HPC_MASTER"], flag="DLROVER_HPC_MASTER")
    if master is None:
        master = find_master(job_dir)
    token = resolve_token(job_dir, create=False)
    return asyncio.run(Agent(config, master=master, token=token, job_dir=job_dir).run())


def _run_standalone(config: RunConfig) -> int:
    job_dir = make_job_dir(
        config.job_dir or os.path.join(os.getcwd(), ".dlrover-hpc", f"standalone-{os.getpid()}")
    )
    token = secrets.token_hex(32)
    master = MasterThread(
        MasterConfig(
            host="127.0.0.1",
            port=0,
            nnodes=NodeRange(min=1, max=1),
            job_dir=str(job_dir),
            job_id=config.run_id or f"standalone-{os.getpid()}",
            max_restarts=config.max_restarts,
            last_call_s=0.0,
        ),
        token=token,
        job_dir=job_dir,
    )
    port = master.start()
    agent = Agent(config, master=("127.0.0.1", port), token=token, job_dir=job_dir)
    code = asyncio.run(agent.run())
    master.join(timeout_s=10)
    return code
