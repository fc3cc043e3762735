"""What runs where (pure): dlrover-run's arguments per host, active hosts and hot spares.

``dlrover_hpc.cli.launch`` checks the user's dlrover-run arguments with dlrover-run's own parser
and hands the result here as a :class:`RunArgs`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TypeVar

from dlrover_hpc.config import NodeRange
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.ssh.blocklist import BlockedHost
from dlrover_hpc.ssh.errors import LaunchError
from dlrover_hpc.ssh.hostfile import HostEntry

T = TypeVar("T")

# Set by the launcher for every host; dropped from the user's arguments.
_VALUE_FLAGS = frozenset(
    {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--master", "--job-dir"}
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunArgs:
    """``dlrover-run``'s arguments after ``launch ... --``, checked (by the CLI) and split."""

    options: tuple[str, ...]  # dlrover-run options, less those the launcher sets per host
    script: tuple[str, ...]  # the training script and its arguments
    nnodes: NodeRange | None  # None: --nnodes was not given
    nproc_per_node: str
    max_restarts: int
    node_unit: int
    job_dir: str | None
    segment: int = 1  # --segment: the master forms rounds of whole segments

    def agent_argv(
        self, *, program: str, nnodes: NodeRange, nproc: str, master: str, job_dir: str
    ) -> list[str]:
        return [
            program,
            *self.options,
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--master={master}",
            f"--job-dir={job_dir}",
            *self.script,
        ]


def drop_launcher_flags(options: Sequence[str]) -> tuple[str, ...]:
    """The user's dlrover-run options less those the launcher sets per host."""
    kept: list[str] = []
    skip = False
    for token in options:
        if skip:
            skip = False
            continue
        name, eq, _ = token.partition("=")
        if name in _VALUE_FLAGS:
            skip = not eq
            continue
        if token != "--":
            kept.append(token)
    return tuple(kept)


def job_nnodes(
    *, requested: NodeRange | None, usable: int, spares: int, hostfile: str
) -> NodeRange:
    """``--nnodes`` of the job: as given, else every usable host but the ``spares`` last."""
    if requested is not None:
        return requested
    active = usable - spares
    if active < 1:
        raise ConfigError(
            f"--spares={spares} leaves no host to train on: {hostfile} has {usable} usable "
            "host(s); lower --spares or add hosts"
        )
    return NodeRange(min=active, max=active)


def split_hosts(hosts: Sequence[T], *, nnodes: NodeRange) -> tuple[list[T], list[T]]:
    """The first ``nnodes.max`` hosts are active; the rest are hot spares."""
    return list(hosts[: nnodes.max]), list(hosts[nnodes.max :])


def drop_blocked(
    hosts: Sequence[HostEntry], blocked: Mapping[str, BlockedHost]
) -> tuple[list[HostEntry], list[tuple[HostEntry, BlockedHost]]]:
    """The hosts not on a blocklist, and those that are (with their blocklist entry)."""
    usable = [h for h in hosts if h.name not in blocked]
    return usable, [(h, blocked[h.name]) for h in hosts if h.name in blocked]


def too_few_hosts(
    count: int,
    *,
    what: str,
    hostfile: str,
    total: int,
    nnodes: NodeRange,
    problems: Sequence[str],
) -> LaunchError:
    detail = "".join(f"\n  {line}" for line in problems)
    return LaunchError(
        f"only {count} {what} host(s) of {total} in {hostfile}, but --nnodes={nnodes} needs "
        f"at least {nnodes.min}:{detail}\nfix or replace these hosts, or lower --nnodes"
    )
