"""What runs where (pure): dlrover-run's arguments per host, active hosts and hot spares."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from typing import NoReturn, TypeVar

from dlrover_hpc.cli.run_args import build_parser, config_from_args
from dlrover_hpc.config import NodeRange
from dlrover_hpc.errors import ConfigError, UsageError
from dlrover_hpc.ssh.blocklist import BlockedHost
from dlrover_hpc.ssh.errors import LaunchError
from dlrover_hpc.ssh.hostfile import HostEntry

T = TypeVar("T")

# Set by the launcher for every host; dropped from the user's arguments.
_VALUE_FLAGS = frozenset(
    {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--master", "--job-dir"}
)
RUN_EXAMPLE = "-- --nnodes=2:2 --nproc-per-node=2 train.py --steps 100"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunArgs:
    """``dlrover-run``'s arguments after ``launch ... --``, checked and split."""

    options: tuple[str, ...]  # dlrover-run options, less those the launcher sets per host
    script: tuple[str, ...]  # the training script and its arguments
    nnodes: NodeRange | None  # None: --nnodes was not given
    nproc_per_node: str
    max_restarts: int
    node_unit: int
    job_dir: str | None

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


def _raise_usage(message: str) -> NoReturn:
    raise UsageError(f"dlrover-run arguments: {message}")


def parse_run_args(tokens: Sequence[str]) -> RunArgs:
    """Check the arguments with dlrover-run's own parser; raises UsageError (exit 2)."""
    tokens = list(tokens)
    if tokens[:1] == ["--"]:
        tokens = tokens[1:]
    if not tokens:
        raise UsageError(f"launch needs dlrover-run's arguments after '--', e.g. {RUN_EXAMPLE}")
    parser = build_parser()
    parser.error = _raise_usage  # type: ignore[method-assign]
    args = parser.parse_args(tokens)
    split = len(tokens) - len(args.training_script_args) - 1
    if split < 0 or tokens[split] != args.training_script:
        raise UsageError(f"cannot find the training script in {' '.join(tokens)}")
    given = {t.split("=", 1)[0] for t in tokens[:split] if t.startswith("-")}
    if "--standalone" in given:
        raise UsageError("launch runs the job master itself; drop --standalone")
    if "--master" in given:
        raise UsageError("launch runs the job master itself; drop --master")
    checked = argparse.Namespace(**vars(args))
    if str(args.nproc_per_node) in ("auto", "cpu", "gpu"):
        checked.nproc_per_node = "1"  # resolved on each host, not here
    try:
        config_from_args(checked)
    except ConfigError as exc:
        raise UsageError(f"dlrover-run arguments: {exc}") from None
    return RunArgs(
        options=_drop_flags(tokens[:split]),
        script=tuple(tokens[split:]),
        nnodes=NodeRange.parse(args.nnodes) if "--nnodes" in given else None,
        nproc_per_node=str(args.nproc_per_node),
        max_restarts=int(args.max_restarts),
        node_unit=int(args.node_unit),
        job_dir=args.job_dir,
    )


def _drop_flags(options: Sequence[str]) -> tuple[str, ...]:
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
