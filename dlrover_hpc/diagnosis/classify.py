"""Pure failure classification: what the evidence of a failed worker says about its node.

`classify(evidence)` answers one question for the failure policy: restart the processes in place
(`SOFTWARE`), take the node out (`HARDWARE`), or replace a node that is gone (`NODE_LOST`).

Lines of the kernel log, the torchelastic error file and the log tail are matched against a rule
table, first match per line wins, in this order: the configured hardware patterns, the configured
software patterns, then `LINE_RULES`. The software rules that come before the hardware ones are the
look-alikes (an NCCL "Cuda failure 'out of memory'" is the program's fault, not the GPU's).
Then the decision, first that applies:

1. the node is unreachable                      -> NODE_LOST
2. a line names a broken GPU or host (Xid, ECC, off the bus, NVLink, machine check, or a
   configured hardware pattern)                -> HARDWARE, whatever the signal (SIGBUS too)
3. the OOM killer took the worker               -> SOFTWARE "oom" (SIGKILL with OOM evidence)
3b. an NCCL or fabric error (`WEAK_HARDWARE_RULES`: these also show up on healthy nodes whose
   peer died, so explicit OOM evidence outranks them) -> HARDWARE
4. a configured software pattern matched        -> SOFTWARE "configured_software"
5. a software line rule matched (CUDA OOM, ...)  -> SOFTWARE, that rule
6. a crash signal (SIGSEGV, SIGBUS, SIGABRT...)  -> SOFTWARE "crash_signal"
7. SIGKILL / SIGTERM without OOM evidence       -> SOFTWARE "killed" / "terminated"
8. a Python exception (error file, log)         -> SOFTWARE "python_exception"
9. a non-zero exit code                         -> SOFTWARE "exit_code", else "unknown"

Software is the default: a process restart is cheap, and a node that keeps failing is caught by
the policy's restart count and by the network check.
"""

from __future__ import annotations

import enum
import functools
import json
import re
import signal as signal_module
from collections.abc import Iterable
from dataclasses import dataclass

from dlrover_hpc.errors import ConfigError

MAX_EVIDENCE_LINES = 8
MAX_LINE_CHARS = 300

# NVIDIA Xid codes that mean the GPU, its memory or its links are at fault (NVIDIA's Xid
# catalogue). Application-caused Xids (13, 31, 43, 45) are software; other codes decide nothing.
HARDWARE_XIDS = frozenset({48, 56, 57, 61, 62, 64, 74, 79, 92, 94, 95, 119, 120, 140})
SOFTWARE_XIDS = frozenset({13, 31, 43, 45})

CRASH_SIGNALS = frozenset(
    {
        signal_module.SIGSEGV,
        signal_module.SIGBUS,
        signal_module.SIGILL,
        signal_module.SIGFPE,
        signal_module.SIGABRT,
    }
)
STOP_SIGNALS = frozenset({signal_module.SIGTERM, signal_module.SIGINT, signal_module.SIGHUP})


class FailureKind(enum.Enum):
    SOFTWARE = "software"  # restart the worker processes on the same node
    HARDWARE = "hardware"  # the node is faulty: drain or quarantine it, bring a replacement
    NODE_LOST = "node_lost"  # the node stopped answering: replace it


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
)

# Hardware rules whose lines also appear on a healthy node when a peer fails.
WEAK_HARDWARE_RULES = frozenset({"network_fabric", "nccl_system_error", "nccl_cuda_failure"})

_EXCEPTION_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)\b:?")


@functools.lru_cache(maxsize=256)
def _compile_user(regex: str) -> re.Pattern[str]:
    return re.compile(regex, re.IGNORECASE)


def _compile_all(field_name: str, patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
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


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureEvidence:
    """What is known about one failed worker (or lost node).

    `signal` is the signal that ended the worker, if known; a negative `exit_code` (Python's
    `returncode`) or a shell-style 129..159 is read as a signal too. `error_file_text` is the JSON
    text of the torchelastic error file. `kernel_lines` are kernel-log lines already narrowed to
    this failure (see `collect.py`); `notes` are collector findings shown in the diagnosis.
    The extra patterns are regexes from the configuration (case-insensitive).
    """

    exit_code: int | None = None
    signal: int | None = None
    oom_killed: bool = False
    error_file_text: str | None = None
    log_tail: str = ""
    kernel_lines: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    node_unreachable: bool = False
    extra_hardware_patterns: tuple[str, ...] = ()
    extra_software_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("kernel_lines", "notes", "extra_hardware_patterns", "extra_software_patterns"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise ConfigError(f"{name} = {value!r}; expected a list of strings, not a string")
            object.__setattr__(self, name, tuple(value))
        _compile_all("extra_hardware_patterns", self.extra_hardware_patterns)
        _compile_all("extra_software_patterns", self.extra_software_patterns)


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    kind: FailureKind
    rule: str  # stable name of the deciding rule, e.g. "gpu_xid", "oom", "python_exception"
    reason: str  # one sentence for logs and events
    evidence: tuple[str, ...] = ()  # the lines and facts that decided it


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorFileInfo:
    message: str
    traceback: str = ""
    timestamp: str = ""
    parsed: bool = True


def parse_error_file(text: str) -> ErrorFileInfo:
    """Read a torchelastic error file: {"message": {"message": ..., "extraInfo": {...}}}.

    The older flat form {"message": "..."} is accepted; anything else is kept as raw text.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return ErrorFileInfo(message=text.strip(), parsed=False)
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return ErrorFileInfo(message=message)
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        extra = extra if isinstance(extra, dict) else {}
        return ErrorFileInfo(
            message=str(message.get("message", "")),
            traceback=str(extra.get("py_callstack", "")),
            timestamp=str(extra.get("timestamp", "")),
        )
    return ErrorFileInfo(message=text.strip(), parsed=False)


def effective_signal(evidence: FailureEvidence) -> int | None:
    """The signal that ended the worker, from `signal` or from the exit code's encoding."""
    if evidence.signal is not None:
        return evidence.signal
    code = evidence.exit_code
    if code is not None and code < 0:
        return -code
    if code is not None and 128 < code < 160:
        return code - 128
    return None


def classify(evidence: FailureEvidence) -> Diagnosis:
    """Classify one failure; see the module docstring for the order of the rules."""
    if evidence.node_unreachable:
        return Diagnosis(
            kind=FailureKind.NODE_LOST,
            rule="node_lost",
            reason="the node stopped answering (agent heartbeat lost or host unreachable)",
            evidence=evidence.notes,
        )
    error_file = parse_error_file(evidence.error_file_text) if evidence.error_file_text else None
    hits = _match_lines(evidence, _lines(evidence, error_file))
    sig = effective_signal(evidence)
    facts = [*evidence.notes, *_describe_exit(evidence.exit_code, sig)]

    hardware = [h for h in hits if h[0].kind is FailureKind.HARDWARE]
    strong = [h for h in hardware if h[0].name not in WEAK_HARDWARE_RULES]
    if strong:  # the most specific rule decides; weaker lines stay in the evidence
        return _from_hits(FailureKind.HARDWARE, hardware, facts)
    oom_lines = [h for h in hits if h[0].name == "host_oom"]
    if evidence.oom_killed or (oom_lines and sig == signal_module.SIGKILL):
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="oom",
            reason="out of host memory: the kernel OOM killer ended the worker",
            evidence=_cap([*facts, *(line for _, line in oom_lines)]),
        )
    if hardware:
        return _from_hits(FailureKind.HARDWARE, hardware, facts)
    configured = [h for h in hits if h[0].name == "configured_software"]
    if configured:
        return _from_hits(FailureKind.SOFTWARE, configured, facts)
    software = [h for h in hits if h[0].name not in ("host_oom", "configured_software")]
    if software:
        return _from_hits(FailureKind.SOFTWARE, software, facts)
    return _by_exit(sig, evidence, error_file, facts)


def _by_exit(
    sig: int | None,
    evidence: FailureEvidence,
    error_file: ErrorFileInfo | None,
    facts: list[str],
) -> Diagnosis:
    if sig in CRASH_SIGNALS:
        name = signal_module.Signals(sig).name
        hint = " (or a full /dev/shm)" if sig == signal_module.SIGBUS else ""
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="crash_signal",
            reason=f"the worker crashed with {name}{hint}; no hardware error was logged",
            evidence=_cap(facts),
        )
    if sig == signal_module.SIGKILL:
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="killed",
            reason="the worker was killed with SIGKILL without OOM evidence "
            "(by the agent, Slurm or an operator)",
            evidence=_cap(facts),
        )
    if sig in STOP_SIGNALS:
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="terminated",
            reason=f"the worker was stopped by {signal_module.Signals(sig).name}",
            evidence=_cap(facts),
        )
    exception = _exception_line(evidence, error_file)
    if exception:
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="python_exception",
            reason=f"the program raised {_clip(exception)}",
            evidence=_cap([exception, *facts]),
        )
    if evidence.exit_code:
        return Diagnosis(
            kind=FailureKind.SOFTWARE,
            rule="exit_code",
            reason=f"the worker exited with code {evidence.exit_code}",
            evidence=_cap(facts),
        )
    return Diagnosis(
        kind=FailureKind.SOFTWARE,
        rule="unknown",
        reason="no evidence of the cause; treated as a software failure",
        evidence=_cap(facts),
    )


_Hit = tuple[LineRule, str]


def _lines(evidence: FailureEvidence, error_file: ErrorFileInfo | None) -> list[str]:
    lines = list(evidence.kernel_lines)
    if error_file is not None:
        lines += error_file.message.splitlines() + error_file.traceback.splitlines()
    lines += evidence.log_tail.splitlines()
    return [line.strip() for line in lines if line.strip()]


def _match_lines(evidence: FailureEvidence, lines: Iterable[str]) -> list[_Hit]:
    user_rules = [
        LineRule(name="configured_hardware", kind=_HW, pattern=p, reason="configured pattern")
        for p in _compile_all("extra_hardware_patterns", evidence.extra_hardware_patterns)
    ] + [
        LineRule(name="configured_software", kind=_SW, pattern=p, reason="configured pattern")
        for p in _compile_all("extra_software_patterns", evidence.extra_software_patterns)
    ]
    rules = [*user_rules, *LINE_RULES]
    hits: list[_Hit] = []
    for line in lines:
        rule = next((r for r in rules if r.pattern.search(line)), None)
        if rule is not None:
            hits.append((rule, _clip(line)))
    return hits


def _from_hits(kind: FailureKind, hits: list[_Hit], facts: list[str]) -> Diagnosis:
    order = {r.name: i for i, r in enumerate(LINE_RULES)}
    # The most specific rule decides: user rules first, then the table's order.
    first = min(hits, key=lambda h: order.get(h[0].name, -1))[0]
    reason = first.reason
    if first.name.startswith("configured_"):
        reason = f"log matches a configured {kind.value} pattern: {first.pattern.pattern!r}"
    lines = list(dict.fromkeys(line for _, line in hits))
    return Diagnosis(
        kind=kind,
        rule=first.name,
        reason=reason,
        evidence=_cap([*lines, *facts]),
    )


def _exception_line(evidence: FailureEvidence, error_file: ErrorFileInfo | None) -> str | None:
    if error_file is not None and error_file.message.strip():
        return error_file.message.strip().splitlines()[0]
    for line in reversed(evidence.log_tail.splitlines()):
        if _EXCEPTION_LINE.match(line):
            return line.strip()
    return None


def _describe_exit(exit_code: int | None, sig: int | None) -> list[str]:
    facts = []
    if sig is not None:
        try:
            facts.append(f"signal {signal_module.Signals(sig).name} ({sig})")
        except ValueError:
            facts.append(f"signal {sig}")
    if exit_code is not None:
        facts.append(f"exit code {exit_code}")
    return facts


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..."


def _cap(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(list(dict.fromkeys(items))[:MAX_EVIDENCE_LINES])
