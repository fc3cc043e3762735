"""Validated, frozen configuration of the agent (``dlrover-run``) and the job master."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from enum import Enum

from dlrover_hpc.errors import ConfigError


class DrainMode(Enum):
    SCONTROL = "scontrol"
    QUARANTINE = "quarantine"
    OFF = "off"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeRange:
    """``--nnodes``: ``N`` or ``MIN:MAX``."""

    min: int
    max: int

    @classmethod
    def parse(cls, text: str, *, flag: str = "--nnodes") -> NodeRange:
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                lo = hi = int(parts[0])
            elif len(parts) == 2:
                lo, hi = int(parts[0]), int(parts[1])
            else:
                raise ValueError(text)
        except ValueError:
            raise ConfigError(
                f"{flag}={text}: expected a node count N or a range MIN:MAX, e.g. {flag}=4 "
                f"or {flag}=2:4"
            ) from None
        return cls._checked(lo, hi, flag)

    @classmethod
    def _checked(cls, lo: int, hi: int, flag: str) -> NodeRange:
        if lo < 1:
            raise ConfigError(f"{flag}={lo}:{hi}: the minimum must be at least 1")
        if lo > hi:
            raise ConfigError(
                f"{flag}={lo}:{hi}: the minimum is larger than the maximum; "
                f"write MIN:MAX with MIN <= MAX, e.g. {flag}={hi}:{lo}"
            )
        return cls(min=lo, max=hi)

    def __str__(self) -> str:
        return f"{self.min}:{self.max}"


def parse_nproc(text: str) -> int:
    """``--nproc-per-node``: a number, or torchrun's ``auto``/``cpu``/``gpu``."""
    if text in ("auto", "gpu"):
        import torch  # only when asked: importing torch is slow

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
        if text == "gpu":
            raise ConfigError("--nproc-per-node=gpu: no CUDA device is visible on this node")
        text = "cpu"
    if text == "cpu":
        return os.cpu_count() or 1
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node={text}: expected a number of workers or auto, cpu, gpu"
        ) from None
    if value < 1:
        raise ConfigError(f"--nproc-per-node={value}: needs at least 1 worker per node")
    return value


def parse_host_port(text: str, *, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{flag}={text}: expected HOST:PORT, e.g. {flag}=node1:29400")
    return host.strip("[]"), int(port)


def env_default(name: str, default: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """Default of a flag from ``DLROVER_HPC_<NAME>`` (flags win over the environment)."""
    env = os.environ if env is None else env
    return env.get("DLROVER_HPC_" + name.upper().replace("-", "_"), default)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MasterConfig:
    host: str = "0.0.0.0"
    port: int = 0
    nnodes: NodeRange = NodeRange(min=1, max=1)
    node_unit: int = 1
    topology: str | None = None
    drain: DrainMode = DrainMode.SCONTROL
    job_dir: str = ".dlrover-hpc"
    job_id: str = "standalone"
    max_restarts: int = 3
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 15.0
    last_call_s: float = 3.0
    rendezvous_timeout_s: float = 600.0
    min_nodes_timeout_s: float = 300.0
    netcheck_timeout_s: float = 30.0
    replacement_sbatch: str | None = None  # template of replacement jobs; None: no replacements
    requeue: bool = True  # below MIN nodes for min_nodes_timeout_s: scontrol requeue (Slurm)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port}: expected 0 (pick a free port) to 65535")
        if self.node_unit < 1:
            raise ConfigError(f"--node-unit={self.node_unit}: must be at least 1")
        if self.node_unit > self.nnodes.max:
            raise ConfigError(
                f"--node-unit={self.node_unit} is larger than the maximum node count "
                f"{self.nnodes.max}; lower --node-unit or raise --nnodes"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts={self.max_restarts}: must be 0 or more")
        if self.heartbeat_interval_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"heartbeat interval {self.heartbeat_interval_s} s must be shorter than the "
                f"heartbeat timeout {self.heartbeat_timeout_s} s"
            )
