"""What is known about one failed worker: `FailureEvidence`, its error file and its signal.

The collectors (`collect.py`) fill a `FailureEvidence`; `classify.py` reads it. The helpers here
decode what the evidence holds: the torchelastic error file and the signal hidden in an exit code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dlrover_hpc.diagnosis.rules import compile_patterns
from dlrover_hpc.errors import ConfigError


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
        compile_patterns("extra_hardware_patterns", self.extra_hardware_patterns)
        compile_patterns("extra_software_patterns", self.extra_software_patterns)


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
