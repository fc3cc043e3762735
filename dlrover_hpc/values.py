"""The settings' value types and their parsers: what a flag's text becomes.

Beneath :mod:`dlrover_hpc.settings` (whose declarations name these types, defaults and parsers)
and :mod:`dlrover_hpc.config` (whose dataclasses hold them); a parser raises a ConfigError that
names the flag and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from enum import Enum
from typing import TypeVar

from dlrover_hpc.errors import ConfigError

E = TypeVar("E", bound=Enum)


def _choice(kind: type[E], text: str, flag: str) -> E:
    """The member of ``kind`` whose value ``text`` is; a ConfigError names ``flag`` and the
    choices."""
    try:
        return kind(text)
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise ConfigError(f"{flag}={text}: expected one of {choices}") from None


class RequeueBy(Enum):
    """Who continues a job at a time limit or preemption (Slurm's USR1, SIGTERM)."""

    #: the master saves at a step boundary and continues the job; USR1 never reaches a worker,
    #: so a framework's own requeue (Lightning's auto-requeue) does not run as well
    DLROVER_HPC = "dlrover-hpc"
    #: the agents pass USR1 on to the workers and the master continues nothing: the
    #: framework's handler (Lightning's SLURMEnvironment, a script's own) requeues the job
    FRAMEWORK = "framework"

    @classmethod
    def parse(cls, text: str) -> RequeueBy:
        """``--requeue-by``'s value (a default from the environment skips argparse's check)."""
        return _choice(cls, text, "--requeue-by")


class DrainMode(Enum):
    SCONTROL = "scontrol"
    QUARANTINE = "quarantine"
    OFF = "off"

    @classmethod
    def parse(cls, text: str) -> DrainMode:
        """``--drain``'s value (a default from the environment skips argparse's check)."""
        return _choice(cls, text, "--drain")


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


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``--rdzv-conf``: ``KEY=VALUE,...`` (torchrun's spelling)."""
    out: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf={text}: expected KEY=VALUE,..., got {item!r}")
        out[key.strip()] = value.strip()
    return out


#: ``--hang-timeout auto`` (the default): how long no rank may progress is learned from the
#: job's own step times, with its own bound for each long phase (:mod:`dlrover_hpc.master.hangs`);
#: a number of seconds is a fixed bound for everything; 0 is off.  ``auto`` is this sentinel.
HANG_AUTO = -1.0
#: With ``auto`` no bound is longer than this (gloo's and NCCL's own collective timeout).
HANG_CEILING_S = 1800.0


def parse_hang_timeout(text: str, flag: str = "--hang-timeout") -> float:
    """``auto`` (:data:`HANG_AUTO`), 0 (off) or a positive number of seconds."""
    if text.strip().lower() == "auto":
        return HANG_AUTO
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value >= 0 and math.isfinite(value)):  # -1 too: auto is spelt "auto"
        raise ConfigError(
            f"{flag}={text}: must be auto, 0 (off) or seconds, e.g. {flag}={HANG_CEILING_S:g}"
        )
    return value


def describe_hang_timeout(value: float) -> str:
    return "auto" if value == HANG_AUTO else ("off" if value == 0 else f"{value:g} s")


#: ``--persist-every auto``: the interval between persists is chosen for the job (Young/Daly,
#: :mod:`dlrover_hpc.master.persist_interval`); a number is fixed seconds; 0 (``off``) is none.
PERSIST_AUTO = -1.0
_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_persist_every(text: str, flag: str = "--persist-every") -> float:
    """``auto`` (:data:`PERSIST_AUTO`), ``off`` or 0 (none) or a positive duration (seconds,
    or with a unit: 90s, 10m, 1h)."""
    word = str(text).strip().lower()
    if word == "auto":
        return PERSIST_AUTO
    if word in ("", "off", "0"):
        return 0.0
    try:
        return parse_duration(word, flag, allow_zero=False)
    except ConfigError:
        raise ConfigError(
            f"{flag}={text}: must be auto, off or a duration, e.g. {flag}=auto or {flag}=10m"
        ) from None


def parse_duration(text: str, flag: str, *, allow_zero: bool = False) -> float:
    """Seconds from ``N``, ``Ns``, ``Nm``, ``Nh`` or ``Nd`` (N a number); positive, unless
    ``allow_zero``."""
    word = str(text).strip().lower()
    unit = word[-1:] if word[-1:] in _UNITS and not word[-1:].isdigit() else ""
    try:
        value = float(word[: len(word) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
        raise ConfigError(
            f"{flag}={text}: must be a positive duration: seconds, or a number with a unit "
            f"s, m, h or d, e.g. {flag}=7d"
        )
    return value


def describe_persist_every(value: float) -> str:
    return "auto" if value == PERSIST_AUTO else ("off" if value == 0 else f"{value:g} s")
