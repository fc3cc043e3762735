"""Running the system commands (ip, tc, apt-get...) that the test clusters are built with."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Sequence


def run_checked(
    argv: Sequence[str],
    *,
    error: type[Exception],
    check: bool = True,
    timeout_s: float = 60.0,
) -> str:
    """stdout of ``argv``; ``error`` with the command and its stderr when it fails."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise error(f"{argv[0]}: command not found ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise error(f"{shlex.join(argv)}: no answer within {timeout_s:.0f} s") from exc
    if check and proc.returncode != 0:
        raise error(
            f"{shlex.join(argv)} failed with exit code {proc.returncode}: {proc.stderr.strip()}"
        )
    return proc.stdout
