"""``dlrover-hpc status``: the master's node table."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from pathlib import Path

from dlrover_hpc.cli.run_args import default_job_dir
from dlrover_hpc.config import parse_host_port
from dlrover_hpc.errors import DlroverHpcError
from dlrover_hpc.master.server import resolve_token
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient


async def fetch_status(host: str, port: int, token: str) -> m.StatusReply:
    client = await MasterClient.connect(host, port, token=token)
    try:
        return await client.request(m.StatusRequest(), m.StatusReply, timeout_s=10)
    finally:
        await client.close()


def format_status(status: m.StatusReply) -> str:
    lines = [
        f"job {status.job_id}: {status.state}, round {status.round}, "
        f"restarts {status.restart_count}/{status.max_restarts}",
        f"{'NODE':<16}{'RANK':>5}  {'STATE':<10}{'ROUND':>6}{'NPROC':>6}  AGENT",
    ]
    for n in status.nodes:
        rank = str(n["rank"]) if n["rank"] >= 0 else "-"
        lines.append(
            f"{n['node']:<16}{rank:>5}  {n['state']:<10}{n['round']:>6}"
            f"{n['nproc']:>6}  {n['agent_id']}"
        )
    return "\n".join(lines)


def print_status(*, master: str | None, job_dir: str | None, as_json: bool) -> int:
    directory = Path(job_dir or os.environ.get("DLROVER_HPC_JOB_DIR") or default_job_dir())
    if master:
        host, port = parse_host_port(master, flag="--master")
    else:
        info = json.loads((directory / "master.json").read_text())
        host, port = info["host"], int(info["port"])
    try:
        status = asyncio.run(fetch_status(host, port, resolve_token(directory, create=False)))
    except (OSError, TimeoutError) as exc:
        raise DlroverHpcError(
            f"cannot reach the job master at {host}:{port} ({exc}); run this where the job's "
            f"nodes resolve, e.g. srun --jobid=JOB --overlap -N1 -n1 dlrover-hpc status"
        ) from None
    if as_json:
        print(json.dumps(dataclasses.asdict(status), indent=1))
    else:
        print(format_status(status))
    return 0
