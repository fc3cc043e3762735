"""Hosts that ``dlrover-hpc launch`` never uses again, and the master's quarantine list.

On Slurm a faulty node is drained; on bare metal there is nobody to tell, so the launcher
writes it to a blocklist instead: ``blocklist.txt`` in the job directory and, with
``--blocklist FILE``, a file shared by every job.  The format is the hostfile's, so an admin
can read and edit it::

    # dlrover-hpc blocklist: `dlrover-hpc launch` starts no agent on these hosts.
    node07  # 2025-06-01T12:00:00Z job launch-20250601-115812-4242: faulty in the network check

Delete a line to use the host again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import hostlist

from dlrover_hpc.ssh.errors import HostfileError

log = logging.getLogger(__name__)

HEADER = (
    "# dlrover-hpc blocklist: `dlrover-hpc launch` starts no agent on these hosts.\n"
    "# One host (or host list) per line; text after '#' says why. Delete a line to use the "
    "host again.\n"
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockedHost:
    name: str
    reason: str
    where: str  # FILE:LINE, for messages


def read_blocklist(path: str | Path) -> dict[str, BlockedHost]:
    """The hosts listed in ``path`` (an absent file blocks nothing)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"{path}: cannot read the blocklist ({exc})") from None
    blocked: dict[str, BlockedHost] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        body, _, comment = raw.partition("#")
        words = body.split()
        if not words:
            continue
        where = f"{path}:{number}"
        if len(words) > 1:
            raise HostfileError(
                f"{where}: unexpected '{words[1]}'; write one host per line, a reason after '#'"
            )
        try:
            names = hostlist.expand_hostlist(words[0], sort=False)
        except hostlist.BadHostlist as exc:
            raise HostfileError(
                f"{where}: '{words[0]}' is not a valid host list ({exc}); write e.g. node07"
            ) from None
        reason = comment.strip() or "no reason given"
        for name in names:
            blocked.setdefault(name, BlockedHost(name=name, reason=reason, where=where))
    return blocked


def block_host(path: str | Path, host: str, *, reason: str, job: str) -> None:
    """Append ``host`` to the blocklist ``path`` (one write with O_APPEND: jobs that share the
    file never interleave their lines)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    why = " ".join(reason.split())
    line = f"{host}  # {stamp} job {job}: {why}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        data = (HEADER + line) if os.fstat(fd).st_size == 0 else line
        os.write(fd, data.encode())
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Quarantined:
    node: str
    reason: str


class QuarantineReader:
    """Reads the master's ``quarantine.jsonl`` as it grows: each call returns the new entries.

    Only complete lines count, so a line being written is picked up on the next call.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def new_entries(self) -> list[Quarantined]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        found: list[Quarantined] = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
                found.append(Quarantined(node=str(record["node"]), reason=str(record["reason"])))
            except (ValueError, KeyError, TypeError):
                log.warning("quarantine line skipped file=%s line=%r", self.path, line[:200])
        return found
