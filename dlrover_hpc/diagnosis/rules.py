"""The rule table of failure classification: which log lines name a hardware or software cause.

`LINE_RULES` is matched in order (first match per line wins), after the patterns a site
configures (`compile_patterns` checks those). The software look-alikes come before the hardware
rules: an NCCL "Cuda failure 'out of memory'" is the program's fault, not the GPU's.
`WEAK_HARDWARE_RULES` are hardware rules whose lines also show up on a healthy node whose peer
died. How the matches decide is `classify.py`'s job.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

from dlrover_hpc.errors import ConfigError

# NVIDIA Xid codes that mean the GPU, its memory or its links are at fault (NVIDIA's Xid
# catalogue). Application-caused Xids (13, 31, 43, 45) are software; other codes decide nothing.
HARDWARE_XIDS = frozenset({48, 56, 57, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140})
SOFTWARE_XIDS = frozenset({13, 31, 43, 45})


class FailureKind(enum.Enum):
    SOFTWARE = "software"  # restart the worker processes on the same node
    HARDWARE = "hardware"  # the node is faulty: drain or quarantine it, bring a replacement
    NODE_LOST = "node_lost"  # the node stopped answering: replace it
    PEER = "peer"  # only lost its connection to a peer that failed first: not its own fault


@dataclass(frozen=True, slots=True, kw_only=True)
class LineRule:
    name: str
    kind: FailureKind
    pattern: re.Pattern[str]
    reason: str


def _rule(name: str, kind: FailureKind, regex: str, reason: str) -> LineRule:
    return LineRule(name=name, kind=kind, pattern=re.compile(regex, re.IGNORECASE), reason=reason)


def _xids(codes: frozenset[int]) -> str:
    # "NVRM: Xid (PCI:0000:3b:00): 79, pid=..." from the driver, "Xid 79" from tools.
    codes_re = "|".join(str(c) for c in sorted(codes))
    return r"\bXid\b(?:\s*\([^)]*\))?\s*:?\s*(?:error\s*)?(?:" + codes_re + r")\b"


_SW = FailureKind.SOFTWARE
_HW = FailureKind.HARDWARE

LINE_RULES: tuple[LineRule, ...] = (
    # Software look-alikes first: they mention CUDA or NCCL but are the program's doing.
    _rule(
        "cuda_oom",
        _SW,
        r"CUDA out of memory|OutOfMemoryError|Cuda failure '?out of memory|"
        r"CUDA error: out of memory|cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED",
        "GPU memory exhausted by the program",
    ),
    _rule(
        "cuda_program_error",
        _SW,
        r"illegal memory access|device-side assert|misaligned address|invalid device ordinal|"
        r"invalid device function|no kernel image is available",
        "CUDA error caused by the program or its build",
    ),
    _rule("gpu_app_xid", _SW, _xids(SOFTWARE_XIDS), "GPU Xid caused by the application"),
    _rule(
        "host_oom",
        _SW,
        r"Out of memory: Kill(?:ed)? process|Memory cgroup out of memory|invoked oom-killer|"
        r"oom-kill:|oom_kill event|OOM Killed|oom-killer",
        "host memory exhausted; the kernel OOM killer ended a process",
    ),
    # Hardware.
    _rule("gpu_xid", _HW, _xids(HARDWARE_XIDS), "GPU hardware error reported as an Xid"),
    _rule(
        "gpu_ecc",
        _HW,
        r"uncorrectable ECC|ECC error.{0,40}uncorrect|ECCUncorrectable|ECC_UNCORRECTABLE|"
        r"double[- ]bit ECC|row[- ]remap(?:ping)? failure|uncontained (?:ECC|memory) error",
        "uncorrectable GPU memory (ECC) error",
    ),
    _rule(
        "gpu_lost",
        _HW,
        r"fallen off the bus|GPU is lost|GPU requires reset|Unable to determine the device handle|"
        r"no CUDA-capable device is detected|cudaErrorNoDevice|CUDA_ERROR_NO_DEVICE|"
        r"cudaErrorDevicesUnavailable|GPU access blocked by the operating system",
        "GPU unavailable or fallen off the bus",
    ),
    _rule(
        "nvlink",
        _HW,
        r"\bNVLink\b.{0,80}\b(?:error|fatal|failure|down)\b|\bNVSwitch\b.{0,80}\b(?:fatal|error)\b",
        "NVLink/NVSwitch fabric error",
    ),
    _rule(
        "host_hardware",
        _HW,
        r"\[Hardware Error\]|Machine check events logged|Machine Check Exception|"
        r"EDAC MC\d+: \d+ UE",
        "host CPU or memory hardware error (machine check)",
    ),
    _rule(
        "network_fabric",
        _HW,
        r"NET/IB\s*:.{0,80}(?:Got completion|async event|error)|\bibv_\w+ failed|"
        r"IBV_WC_RETRY_EXC_ERR|transport retry counter exceeded|local catastrophic error|"
        r"\bmlx\d_\d+\b.{0,60}\b(?:port \d+ )?(?:down|error)\b",
        "InfiniBand/RoCE fabric error (run the network check to find the faulty node)",
    ),
    _rule(
        "nccl_system_error",
        _HW,
        r"unhandled system error",
        "NCCL system error (network or driver fault)",
    ),
    _rule(
        "nccl_cuda_failure",
        _HW,
        r"Cuda failure\b",
        "NCCL hit a CUDA failure on this node's GPU",
    ),
    _rule(
        "peer_lost",
        FailureKind.PEER,
        # gloo: "Connection closed by peer [addr]:port. This is typically caused by a remote
        # worker crashing"; NCCL: "remote process exited or there was a network error".
        r"Connection (?:closed|reset) by peer|remote process exited or there was a network error",
        "a peer rank's connection closed: another worker or node failed first",
    ),
)

# Hardware rules whose lines also appear on a healthy node when a peer fails.
WEAK_HARDWARE_RULES = frozenset({"network_fabric", "nccl_system_error", "nccl_cuda_failure"})


@functools.lru_cache(maxsize=256)
def _compile_user(regex: str) -> re.Pattern[str]:
    return re.compile(regex, re.IGNORECASE)


def compile_patterns(field_name: str, patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """A site's ``field_name`` patterns, compiled case-insensitive; ConfigError names a bad one."""
    compiled = []
    for i, regex in enumerate(patterns):
        if not isinstance(regex, str) or not regex:
            raise ConfigError(f"{field_name}[{i}] = {regex!r}; expected a non-empty regex string")
        try:
            compiled.append(_compile_user(regex))
        except re.error as e:
            raise ConfigError(
                f"{field_name}[{i}] = {regex!r} is not a valid regular expression ({e}); "
                "escape special characters such as ( [ . * with a backslash"
            ) from e
    return tuple(compiled)
