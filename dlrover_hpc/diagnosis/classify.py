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
5b. a peer's connection closed (gloo, NCCL) and the worker was not killed by a signal, or
   only aborted after it (SIGABRT: "terminate called without an active exception" as the
   lost connection's exception unwinds)
   -> PEER: a symptom of another failure; the master charges no restart for it when a node
   is lost meanwhile (a membership change), and charges one when none is
6. a crash signal (SIGSEGV, SIGBUS, SIGABRT...)  -> SOFTWARE "crash_signal"
7. SIGKILL / SIGTERM without OOM evidence       -> SOFTWARE "killed" / "terminated"
8. a Python exception (error file, log)         -> SOFTWARE "python_exception"
9. a non-zero exit code                         -> SOFTWARE "exit_code", else "unknown"

Software is the default: a process restart is cheap, and a node that keeps failing is caught by
the policy's restart count and by the network check.
"""

from __future__ import annotations

import re
import signal as signal_module
from collections.abc import Iterable
from dataclasses import dataclass

from dlrover_hpc.diagnosis.evidence import (
    ErrorFileInfo,
    FailureEvidence,
    effective_signal,
    parse_error_file,
)
from dlrover_hpc.diagnosis.rules import (
    LINE_RULES,
    WEAK_HARDWARE_RULES,
    FailureKind,
    LineRule,
    compile_patterns,
)

__all__ = [
    "Diagnosis",
    "ErrorFileInfo",
    "FailureEvidence",
    "FailureKind",
    "classify",
    "effective_signal",
    "parse_error_file",
]

MAX_EVIDENCE_LINES = 8
MAX_LINE_CHARS = 300

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

_EXCEPTION_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)\b:?")


@dataclass(frozen=True, slots=True, kw_only=True)
class Diagnosis:
    kind: FailureKind
    rule: str  # stable name of the deciding rule, e.g. "gpu_xid", "oom", "python_exception"
    reason: str  # one sentence for logs and events
    evidence: tuple[str, ...] = ()  # the lines and facts that decided it


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
    software = [
        h
        for h in hits
        if h[0].kind is FailureKind.SOFTWARE
        and h[0].name not in ("host_oom", "configured_software")
    ]
    if software:
        return _from_hits(FailureKind.SOFTWARE, software, facts)
    peer = [h for h in hits if h[0].kind is FailureKind.PEER]
    own_signal = sig in CRASH_SIGNALS and sig != signal_module.SIGABRT
    if peer and not own_signal and sig != signal_module.SIGKILL:
        return _from_hits(FailureKind.PEER, peer, facts)
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
        LineRule(
            name="configured_hardware",
            kind=FailureKind.HARDWARE,
            pattern=p,
            reason="configured pattern",
        )
        for p in compile_patterns("extra_hardware_patterns", evidence.extra_hardware_patterns)
    ] + [
        LineRule(
            name="configured_software",
            kind=FailureKind.SOFTWARE,
            pattern=p,
            reason="configured pattern",
        )
        for p in compile_patterns("extra_software_patterns", evidence.extra_software_patterns)
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
