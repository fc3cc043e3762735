"""``dlrover-hpc status``: find the job master (``--master`` or ``master.json``), show its table.

Every way of not finding it is an error that says what is wrong and what to run instead:
bad input (a job directory that does not exist, no job at all) is a UsageError (exit 2); a job
without a live master (no ``master.json``, a stale or unreadable one) is a DlroverHpcError (exit 1).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from dlrover_hpc import environ, jobdir
from dlrover_hpc.config import parse_host_port
from dlrover_hpc.errors import DlroverHpcError, UsageError
from dlrover_hpc.jobdir import MASTER_INFO, default_job_dir, load_master_info, resolve_token
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient

STATUS_TIMEOUT_S = 10.0
STACKS_TIMEOUT_S = 30.0  # the master waits up to 15 s for the agents' stacks
IN_JOB = "srun --jobid=JOB --overlap -N1 -n1 dlrover-hpc status"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MasterInfo:
    """Where the master listens: from ``--master``, or its ``master.json`` (``path`` set)."""

    host: str
    port: int
    pid: int | None = None
    path: Path | None = None


def find_job_dir(job_dir: str | None, env: Mapping[str, str] | None = None) -> Path:
    """``--job-dir`` (or :data:`environ.JOB_DIR`), else the Slurm job's default directory."""
    env = os.environ if env is None else env
    if job_dir:
        path = Path(job_dir)
        if not path.is_dir():
            raise UsageError(
                f"job directory {path} does not exist; pass --job-dir with the directory of a "
                "running job (SUBMIT_DIR/.dlrover-hpc/JOB_ID) or --master HOST:PORT"
            )
        return path
    path = Path(default_job_dir(env))
    if env.get("SLURM_JOB_ID"):
        if not path.is_dir():
            raise DlroverHpcError(
                f"Slurm job {env['SLURM_JOB_ID']} has no job directory {path}: no dlrover-hpc "
                "master has run in it; start one with 'dlrover-hpc master' (the sbatch templates "
                "do), or pass --job-dir DIR of the job you mean"
            )
        return path
    if (path / MASTER_INFO).is_file():  # `dlrover-hpc master` started here without Slurm
        return path
    raise UsageError(
        "not inside a job: SLURM_JOB_ID is not set and no --job-dir was given; run "
        f"'dlrover-hpc status --job-dir DIR'{_example_dirs(path.parent)}, or inside the job: "
        f"'{IN_JOB}'"
    )


def _example_dirs(root: Path) -> str:
    """`` (e.g. .dlrover-hpc/123)``: the newest job directories under the current directory."""
    try:
        found = [p for p in root.iterdir() if (p / MASTER_INFO).is_file()]
    except OSError:
        return ""
    if not found:
        return ""
    newest = max(found, key=lambda p: (p / MASTER_INFO).stat().st_mtime)
    return f" (e.g. --job-dir {os.path.relpath(newest)})"


def read_master_info(job_dir: Path) -> MasterInfo:
    path = job_dir / MASTER_INFO
    try:
        info = load_master_info(job_dir)
        return MasterInfo(
            host=str(info["host"]),
            port=int(info["port"]),
            pid=int(info["pid"]) if info.get("pid") is not None else None,
            path=path,
        )
    except FileNotFoundError:
        raise DlroverHpcError(
            f"no job master: {path} does not exist, so no master has started in this job "
            f"directory; start one with 'dlrover-hpc master --job-dir {job_dir}' (the sbatch "
            "templates do), or pass --master HOST:PORT"
        ) from None
    except PermissionError:
        raise DlroverHpcError(
            f"cannot read {path}: permission denied (job directories are private to the user "
            "who runs the job); run 'dlrover-hpc status' as that user"
        ) from None
    except OSError as exc:
        raise DlroverHpcError(f"cannot read {path} ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON, fields, types
        raise DlroverHpcError(
            f"{path} is not a master address file ({type(exc).__name__}: {exc}); remove it and "
            f"restart the master with 'dlrover-hpc master --job-dir {job_dir}'"
        ) from None


def _is_local(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", socket.gethostname().split(".")[0])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _stale(info: MasterInfo, why: str) -> DlroverHpcError:
    job_dir = info.path.parent if info.path is not None else "DIR"
    return DlroverHpcError(
        f"stale {info.path}: {why}, so the job master has stopped; see the job's output and "
        f"events.jsonl, or start a new master with 'dlrover-hpc master --job-dir {job_dir}'"
    )


def unreachable(info: MasterInfo, exc: BaseException) -> DlroverHpcError:
    """An error from connecting to (or asking) the master, in words."""
    where = f"{info.host}:{info.port}"
    if isinstance(exc, ConnectionRefusedError):
        if info.path is None:
            return DlroverHpcError(
                f"nothing listens on {where} (connection refused); check --master (or "
                f"{environ.MASTER}), or drop it to use the job directory's master.json"
            )
        alive = ""
        if info.pid is not None and _is_local(info.host) and _pid_alive(info.pid):
            alive = f" although its pid {info.pid} is still running"
        return _stale(info, f"nothing listens on {where} (connection refused){alive}")
    if isinstance(exc, socket.gaierror):
        return DlroverHpcError(
            f"cannot resolve the master's host {info.host!r} ({exc.strerror}); run this where "
            f"the job's nodes resolve, e.g. '{IN_JOB}'"
        )
    if isinstance(exc, TimeoutError):
        return DlroverHpcError(
            f"the job master at {where} did not answer within {STATUS_TIMEOUT_S:.0f} s; it may "
            f"be overloaded or on a dead node: try again, or run this inside the job: '{IN_JOB}'"
        )
    reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return DlroverHpcError(
        f"cannot reach the job master at {where} ({reason}); run this where the job's nodes "
        f"resolve, e.g. '{IN_JOB}'"
    )


async def fetch_status(host: str, port: int, token: str, *, nodes: bool = True) -> m.StatusReply:
    """The master's status; `nodes=False`: a summary when the job is large (see
    `m.StatusRequest`)."""
    client = await MasterClient.connect(host, port, token=token, timeout_s=STATUS_TIMEOUT_S)
    try:
        return await client.request(
            m.StatusRequest(nodes=nodes), m.StatusReply, timeout_s=STATUS_TIMEOUT_S
        )
    finally:
        await client.close()


def nodes_line(status: m.StatusReply) -> str:
    """``nodes: 4096 (active 4090, waiting 2, lost 4)``, the most common state first."""
    counts = status.node_states or dict(collections.Counter(str(n.state) for n in status.nodes))
    parts = ", ".join(f"{s} {c}" for s, c in sorted(counts.items(), key=lambda kv: -kv[1]))
    return f"nodes: {sum(counts.values())} ({parts})"


def format_status(status: m.StatusReply) -> str:
    step = str(status.step) if status.step >= 0 else "-"
    lines = [
        f"job {status.job_id}: {status.state}, round {status.round}, "
        f"restarts {status.restart_count}/{status.max_restarts}, step {step} "
        f"({status.step_rate:.2f}/s)"
        + (f", goodput so far {status.goodput:.1%}" if status.goodput >= 0 else ""),
        nodes_line(status),
    ]
    if status.stragglers:
        lines.append(f"stragglers: {', '.join(status.stragglers)}")
    if status.summary:
        lines.append(
            "the slowest running nodes, the stragglers' and those not running "
            "(dlrover-hpc status --nodes: every node):"
        )
    lines.append(
        f"{'NODE':<16}{'RANK':>5}  {'STATE':<10}{'ROUND':>6}{'STEP':>8}{'NPROC':>6}  AGENT"
    )
    for n in status.nodes:
        rank = str(n.rank) if n.rank >= 0 else "-"
        node_step = str(n.step) if n.step >= 0 else "-"
        lines.append(
            f"{n.node:<16}{rank:>5}  {n.state!s:<10}{n.round:>6}{node_step:>8}{n.nproc:>6}  "
            f"{n.agent_id}" + (f"  {n.reason}" if n.reason else "")
        )
    return "\n".join(lines)


def find_master(master: str | None, job_dir: str | None) -> tuple[MasterInfo, str]:
    """The job master's address and the job token."""
    if master:
        host, port = parse_host_port(master, flag="--master")
        info = MasterInfo(host=host, port=port)
        directory = Path(job_dir) if job_dir else Path(default_job_dir())
    else:
        directory = find_job_dir(job_dir)
        info = read_master_info(directory)
        if info.pid is not None and _is_local(info.host) and not _pid_alive(info.pid):
            raise _stale(info, f"its master (pid {info.pid} on {info.host}) is no longer running")
    try:
        token = resolve_token(directory, create=False)
    except PermissionError:
        raise DlroverHpcError(
            f"cannot read {directory / jobdir.TOKEN}: permission denied; run "
            f"'dlrover-hpc status' as the user who runs the job, or set {environ.TOKEN}"
        ) from None
    return info, token


def print_status(
    *, master: str | None, job_dir: str | None, as_json: bool, nodes: bool = False
) -> int:
    """The job's status: every node with `nodes` or up to `m.SUMMARY_OVER` nodes, else a
    summary."""
    info, token = find_master(master, job_dir)
    try:
        status = asyncio.run(fetch_status(info.host, info.port, token, nodes=nodes))
    except (OSError, TimeoutError) as exc:
        raise unreachable(info, exc) from None
    if as_json:
        print(json.dumps(dataclasses.asdict(status), indent=1))
    else:
        print(format_status(status))
    return 0


async def fetch_stacks(host: str, port: int, token: str) -> m.StacksReply:
    client = await MasterClient.connect(host, port, token=token, timeout_s=STATUS_TIMEOUT_S)
    try:  # the agents read their workers' stacks: allow for that
        return await client.request(m.StacksRequest(), m.StacksReply, timeout_s=STACKS_TIMEOUT_S)
    finally:
        await client.close()


def print_stacks(*, master: str | None, job_dir: str | None) -> int:
    """``dlrover-hpc stacks``: every rank's stack now, grouped; kept in the job directory."""
    info, token = find_master(master, job_dir)
    try:
        reply = asyncio.run(fetch_stacks(info.host, info.port, token))
    except (OSError, TimeoutError) as exc:
        raise unreachable(info, exc) from None
    print(reply.text, end="")
    print(f"(each rank's stack: {reply.directory})")
    return 0


async def send_stop(host: str, port: int, token: str, kind: str, reason: str) -> None:
    client = await MasterClient.connect(host, port, token=token, timeout_s=STATUS_TIMEOUT_S)
    try:
        await client.request(m.StopRequest(kind=kind, reason=reason), m.Ack, timeout_s=30)
    finally:
        await client.close()


def request_stop(*, master: str | None, job_dir: str | None, kind: str, reason: str) -> int:
    """``dlrover-hpc stop``: the job saves at a step boundary, ends, and continues."""
    info, token = find_master(master, job_dir)
    try:
        asyncio.run(send_stop(info.host, info.port, token, kind, reason))
    except (OSError, TimeoutError) as exc:
        raise unreachable(info, exc) from None
    print(f"the job saves at its next step and ends ({kind or 'by its time left'}: {reason})")
    return 0
