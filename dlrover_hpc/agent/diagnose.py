"""Classify a failed worker on its node, from the evidence only the node can read."""

from __future__ import annotations

import dataclasses
import logging
import signal as signal_module

from dlrover_hpc.agent.workers import WorkerFailure
from dlrover_hpc.diagnosis.classify import Diagnosis, FailureEvidence, FailureKind, classify
from dlrover_hpc.diagnosis.collect import collect_evidence, read_oom_kill_count, read_uptime_s

log = logging.getLogger(__name__)


class Diagnoser:
    """Remembers the node's OOM-kill count and uptime when workers start, to date evidence."""

    def __init__(
        self, *, hardware_patterns: tuple[str, ...] = (), software_patterns: tuple[str, ...] = ()
    ) -> None:
        self._hardware, self._software = hardware_patterns, software_patterns
        self._oom_before: int | None = None
        self._since: float | None = None

    def workers_starting(self) -> None:
        self._oom_before = read_oom_kill_count()
        self._since = read_uptime_s()

    def diagnose(self, failure: WorkerFailure) -> Diagnosis:
        code = failure.exit_code
        sig = None
        if failure.signal:
            sig = int(getattr(signal_module, failure.signal, 0)) or None
        elif code is not None and code < 0:
            sig = -code
        evidence = collect_evidence(
            exit_code=code if code is not None and code >= 0 else None,
            signal=sig,
            error_file=failure.error_file or None,
            oom_kills_before=self._oom_before,
            since_uptime_s=self._since,
            extra_hardware_patterns=self._hardware,
            extra_software_patterns=self._software,
        )
        if failure.log_tail and not evidence.log_tail:
            evidence = dataclasses.replace(evidence, log_tail=failure.log_tail)
        diagnosis = classify(evidence)
        log.info(
            "failure diagnosed rank=%d kind=%s rule=%s evidence=%s",
            failure.rank,
            diagnosis.kind.value,
            diagnosis.rule,
            list(diagnosis.evidence),
        )
        return diagnosis

    def scan_logs(self, tails: dict[int, str]) -> tuple[int, Diagnosis] | None:
        """Workers stopped for a round change: did one log a hardware fault before it?"""
        for local_rank, tail in sorted(tails.items()):
            if not tail:
                continue
            evidence = FailureEvidence(
                exit_code=None,
                signal=None,
                oom_killed=False,
                error_file_text=None,
                log_tail=tail,
                extra_hardware_patterns=self._hardware,
                extra_software_patterns=self._software,
            )
            diagnosis = classify(evidence)
            if diagnosis.kind is FailureKind.HARDWARE:
                return local_rank, diagnosis
        return None
