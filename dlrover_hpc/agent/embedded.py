"""A master embedded in one agent, for job scripts written for torchrun (issue 14).

A torchrun script under Slurm runs ``srun torchrun --rdzv-endpoint HEAD:PORT ...`` and starts no
job master.  When ``dlrover-run`` finds none (no ``--master``, no :data:`environ.MASTER`, no
live ``master.json``), one agent starts the master in-process and the others find it:

- with ``--rdzv-endpoint HOST:PORT``, the agent on HOST (one of its addresses) listens on PORT,
  as torchrun's c10d store would; the others connect to HOST:PORT;
- without, the agent with ``SLURM_PROCID`` 0 listens on a free port and writes ``master.json``
  in the job directory (``$SLURM_SUBMIT_DIR/.dlrover-hpc/$SLURM_JOB_ID``).

With no job token in the environment (:data:`environ.TOKEN`), the embedded master makes the
job token and writes it to the job directory, which is mode 0700 (the file 0600) on the shared
file system: only the same user's agents can read it.  :func:`plan` is pure; the rest waits on
the network and the file system.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import psutil

from dlrover_hpc import environ, jobdir
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.jobdir import MASTER_INFO, master_address, read_master_info
from dlrover_hpc.slurm.hostnames import expand

log = logging.getLogger(__name__)

#: torchrun's port when ``--rdzv-endpoint`` names none
DEFAULT_RDZV_PORT = 29400


class Without(enum.Enum):
    """What ``dlrover-run`` does when no ``--master`` names the job master (torchrun's habit)."""

    FIND = "find"  # a Slurm job, an endpoint or a live master.json: find or host the master
    STANDALONE = "standalone"  # one node and nothing to join: run as --standalone, as torchrun
    FAIL = "fail"  # several nodes and no way to find their master: say how to give one


def without_master(
    *, nnodes_max: int, master_given: bool, in_slurm: bool, endpoint: bool, live_master: bool
) -> Without:
    """torchrun runs a one-node job without any rendezvous flag; ``dlrover-run`` does the same
    when nothing says there is (or will be) a master to join.  Pure."""
    if master_given or in_slurm or endpoint or live_master:
        return Without.FIND
    return Without.STANDALONE if nnodes_max == 1 else Without.FAIL


def master_json_live(job_dir: Path, *, timeout_s: float = 0.5) -> bool:
    """Whether ``master.json`` in ``job_dir`` names a master that accepts a connection."""
    info = read_master_info(job_dir)
    if info is None:
        return False
    try:
        host, port = master_address(info)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except (OSError, ValueError, KeyError):
        return False


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    host: bool  # this agent starts the master
    port: int  # where it listens (0: any free port, published in master.json)
    endpoint: tuple[str, int] | None  # where every agent connects; None: read master.json


def split_endpoint(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` as torchrun takes it: ``node1``, ``node1:29500``, ``10.0.0.1:29500``,
    ``[fe80::1]:29500``, or a bare IPv6 address."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if not port:
        return host, DEFAULT_RDZV_PORT
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint={text}: expected HOST or HOST:PORT, e.g. --rdzv-endpoint=node1:29500"
        )
    return host, int(port)


def plan(
    *,
    endpoint: str,
    my_addresses: set[str],
    env: Mapping[str, str],
    master_info: Mapping[str, object] | None,
    endpoint_on_job_node: bool = True,
) -> Plan | None:
    """Who starts the master; None when a master of the template exists (``master.json`` not
    written by an embedded one).  ``endpoint_on_job_node``: the endpoint names one of the job's
    nodes (a login node or ``localhost`` in a multi-node job does not: then SLURM_PROCID 0 hosts
    the master on the endpoint's port and the others read ``master.json``)."""
    if endpoint:
        host, port = split_endpoint(endpoint)
        if endpoint_on_job_node:
            return Plan(host=host in my_addresses, port=port, endpoint=(host, port))
        return Plan(host=env.get("SLURM_PROCID", "0") == "0", port=port, endpoint=None)
    if master_info is not None and not master_info.get("embedded"):
        return None
    first = env.get("SLURM_PROCID", "0") == "0"
    return Plan(host=first, port=0, endpoint=None)


def addresses_of(host: str) -> set[str]:
    """``host`` and the addresses it resolves to (none when it does not resolve)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return {host}
    return {host, *(str(info[4][0]) for info in infos)}


def on_job_node(endpoint: str, env: Mapping[str, str]) -> bool:
    """Whether ``--rdzv-endpoint`` names one of the Slurm job's nodes (True outside Slurm:
    there the endpoint is all there is to go by)."""
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return True
    host = split_endpoint(endpoint)[0]
    wanted = addresses_of(host)
    job = {a for node in expand(nodelist, source="SLURM_JOB_NODELIST") for a in addresses_of(node)}
    return bool(wanted & job)


def my_addresses() -> set[str]:
    """Names and addresses under which other nodes reach this one."""
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    for addrs in psutil.net_if_addrs().values():
        names.update(a.address.split("%")[0] for a in addrs if a.family in _INET)
    return {n for n in names if n}


_INET = (socket.AF_INET, socket.AF_INET6)


def wait_reachable(host: str, port: int, *, deadline: float, what: str) -> None:
    """Until HOST:PORT accepts a TCP connection (the host agent may still be starting)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"no job master answered at {host}:{port} ({what}): {exc}; the agent on "
                    "that host starts it, so --rdzv-endpoint must name one of the job's nodes"
                ) from None
            time.sleep(0.3)


def wait_master_json(job_dir: Path, *, deadline: float) -> tuple[str, int]:
    """``master.json`` of a master that accepts connections (a stale one is skipped)."""
    while True:
        info = read_master_info(job_dir)
        if info is not None:
            host, port = master_address(info)
            try:
                socket.create_connection((host, port), timeout=2).close()
                return host, port
            except OSError:
                pass  # left by an earlier run of this job: the new one overwrites it
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"no job master found: {job_dir / MASTER_INFO} did not name a live master "
                "in time; the agent with SLURM_PROCID=0 starts one when no master runs"
            )
        time.sleep(0.3)


def wait_token(job_dir: Path, *, deadline: float) -> str:
    """The token the embedded master wrote (0600, in the 0700 job directory)."""
    if os.environ.get(environ.TOKEN):
        return os.environ[environ.TOKEN]
    path = job_dir / jobdir.TOKEN
    while True:
        try:
            token = path.read_text().strip()
            if token:
                return token
        except FileNotFoundError:
            pass
        except PermissionError:
            raise ConfigError(
                f"{path}: not readable; the job directory belongs to another user"
            ) from None
        if time.monotonic() >= deadline:
            raise ConfigError(f"no job token: {path} did not appear; set {environ.TOKEN}")
        time.sleep(0.2)
