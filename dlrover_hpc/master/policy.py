"""Taking a faulty node out of the job: scontrol drain, or quarantine when Slurm refuses."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from dlrover_hpc.config import DrainMode
from dlrover_hpc.events import EventName
from dlrover_hpc.master.journal import EventLog
from dlrover_hpc.slurm import commands as slurm

log = logging.getLogger(__name__)


class NodeRemover:
    """Runs in a worker thread (it runs scontrol); never raises.

    ``scontrol``: drain the node with a reason naming the job; when Slurm refuses (the user is
    not a Slurm admin), quarantine it instead and log the exact command for an admin.
    ``quarantine``: only quarantine.  Either way the job never admits the node again; the
    quarantine list is kept in the job directory (``quarantine.jsonl``).
    """

    def __init__(
        self,
        *,
        mode: DrainMode,
        job_id: str,
        job_dir: Path,
        events: EventLog,
        run: slurm.Runner = slurm.run_command,
    ) -> None:
        self.mode, self.job_id, self.events = mode, job_id, events
        self._file = job_dir / "quarantine.jsonl"
        self._run = run

    def remove(self, node: str, reason: str) -> None:
        try:
            self._remove(node, reason)
        except Exception:  # thread boundary: log once, the node stays excluded anyway
            log.exception("removing node failed node=%s", node)

    def _remove(self, node: str, reason: str) -> None:
        admin_command = ""
        if self.mode is DrainMode.SCONTROL:
            result = slurm.drain_node(
                node, reason=f"dlrover-hpc: {reason[:150]} job {self.job_id}", run=self._run
            )
            if result.ok:
                self.events.emit(EventName.NODE_DRAINED, node=node, reason=reason)
                return
            admin_command = result.admin_command
            log.warning(
                "Slurm refused to drain node=%s error=%r; quarantining it. An admin can run: %s",
                node,
                result.error,
                admin_command,
            )
        line = json.dumps({"node": node, "reason": reason, "admin_command": admin_command})
        fd = os.open(self._file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        self.events.emit(
            EventName.NODE_QUARANTINED, node=node, reason=reason, admin_command=admin_command
        )
