"""The master's shard service (``dlrover_hpc.data``): one :class:`~dlrover_hpc.data.ledger.Ledger`
per dataset, served on the master's own port to the training processes.

Every change is appended to ``<job dir>/datasets.jsonl`` and fsync'd before the shard is
handed out: a master restarted (or promoted on another node) replays the file and knows
every hand-out, so no sample is handed out twice after a fail-over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from dlrover_hpc.data.ledger import HandOut, Ledger, RoundStart, Spec
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)
FILE = "datasets.jsonl"


class Datasets:
    def __init__(self, job_dir: Path | None) -> None:
        self.path = None if job_dir is None else job_dir / FILE
        self.ledgers: dict[str, Ledger] = {}
        self._replay()

    def _replay(self) -> None:
        if self.path is None or not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            try:
                rec = json.loads(line)
                name = rec["dataset"]
                if "spec" in rec:
                    self.ledgers[name] = Ledger(Spec(**rec["spec"]))
                elif "round" in rec:
                    r = RoundStart(*rec["round"])
                    self.ledgers[name].start_round(r.round, start=r.start, batch_size=r.batch_size)
                else:
                    self.ledgers[name]._add(HandOut(*rec["handout"]))
            except (ValueError, KeyError, TypeError) as exc:
                if number == len(lines):
                    break  # torn by a crash mid-write: that hand-out never reached a worker
                raise ValueError(f"{self.path}, line {number}: {exc}") from None
        for name, ledger in self.ledgers.items():
            log.info("dataset resumed name=%s todo=%s", name, ledger.todo()[:3])

    def _append(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def request(self, msg: m.ShardRequest, *, current_round: int) -> m.ShardReply:
        """The next shard for ``msg.rank``; ValueError (an error reply) for a request of an
        older round or one that disagrees with the dataset's size, shard size or epochs."""
        if msg.round != current_round:
            raise ValueError(
                f"shard request of round {msg.round}, but round {current_round} runs: the "
                "worker is from an old round and is being restarted"
            )
        spec = Spec(size=msg.size, shard_size=msg.shard_size, epochs=msg.epochs)
        ledger = self.ledgers.get(msg.dataset)
        if ledger is None:
            ledger = self.ledgers[msg.dataset] = Ledger(spec)
            self._append({"dataset": msg.dataset, "spec": dataclasses.asdict(spec)})
        elif ledger.spec != spec:
            raise ValueError(
                f"dataset {msg.dataset!r} was registered with {ledger.spec}, this request has "
                f"{spec}: every rank must describe it the same way (or use another name)"
            )
        if msg.round not in ledger.rounds:
            r = ledger.start_round(msg.round, start=msg.start, batch_size=msg.batch_size)
            self._append({"dataset": msg.dataset, "round": [r.round, r.start, r.batch_size]})
            log.info(
                "dataset round name=%s round=%d start_batch=%d trained=%s",
                msg.dataset,
                r.round,
                r.start,
                _count(ledger.trained()),
            )
        handout = ledger.next(msg.round, msg.rank)
        if handout is None:
            return m.ShardReply()
        self._append(
            {
                "dataset": msg.dataset,
                "handout": [
                    handout.round,
                    handout.rank,
                    handout.epoch,
                    handout.start,
                    handout.end,
                    handout.offset,
                ],
            }
        )
        return m.ShardReply(epoch=handout.epoch, start=handout.start, end=handout.end)


def _count(ranges: list[tuple[int, int, int]]) -> int:
    return sum(t - s for _, s, t in ranges)
