"""Commit counting: a step is committed once every rank's part of it is durable.

`CommitCounter` is the one counter: the agent's saver uses it in process (one node), and the
job master uses it for every node's saver (through `MasterCommitCoordinator`).  Under plain
torchrun, with no master, `StoreCommitCoordinator` counts in the torch.distributed Store.
Exactly one caller, the one that completes the set of parts, is told to commit; it then
writes the commit record and the tracker (`commit_records`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any


class CommitCounter:
    """Counts the ranks whose part of (step path, step) is durable; thread-safe.

    `remember` bounds the set of committed steps kept to refuse repeats of a committed step.
    """

    def __init__(self, *, remember: int = 1024) -> None:
        self._lock = threading.Lock()
        self._parts: dict[tuple[str, int], set[int]] = {}
        self._committed: dict[tuple[str, int], None] = {}  # insertion-ordered, bounded
        self._remember = remember

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        """Records `ranks`' parts of `step` (saved at `path`) as durable; True for the one
        call that completes all `world_size` parts."""
        key = (path, step)
        with self._lock:
            if key in self._committed:
                return False
            have = self._parts.setdefault(key, set())
            have.update(ranks)
            if len(have) < world_size:
                return False
            del self._parts[key]
            self._committed[key] = None
            while len(self._committed) > self._remember:
                self._committed.pop(next(iter(self._committed)))
            return True

    def new_generation(self) -> None:
        """Workers restarted: parts saved by the previous generation never complete now."""
        with self._lock:
            self._parts.clear()


#: DLRover-style name of the in-process counter (public API).
LocalCommitCoordinator = CommitCounter


class StoreCommitCoordinator:
    """Part counting in a torch.distributed Store (`add` is atomic) shared by all ranks.

    Used by the in-process saver under plain torchrun, where there is no master (the trainer
    side connects the store: `saver_connection.store_coordinator_from_env`).  Keys are
    scoped by `namespace`, the worker generation, so parts of an older incarnation never count,
    and by the step's path, so two checkpointers of one job (two directories) count apart.
    """

    def __init__(self, store: Any, *, namespace: str = "0") -> None:
        self._store = store
        self.namespace = namespace

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        base = f"dlrover-hpc/ckpt/{self.namespace}/{path}/{step}"
        new = sum(1 for r in ranks if int(self._store.add(f"{base}/r{r}", 1)) == 1)
        if not new:
            return False
        return int(self._store.add(f"{base}/count", new)) == world_size
