"""Checkpoint commits agreed by the master: a step counts once every rank's part is durable."""

from __future__ import annotations

from dlrover_hpc.protocol import messages as m


class CommitCounter:
    """Counts the ranks whose part of a step is durable.  Exactly one caller, the one that
    completes the set, is told to commit (write the commit record and the tracker)."""

    def __init__(self, *, remember: int = 1024) -> None:
        self._parts: dict[tuple[str, int], set[int]] = {}
        self._committed: dict[tuple[str, int], None] = {}  # insertion-ordered, bounded
        self._remember = remember

    def part_durable(self, msg: m.CheckpointPart) -> bool:
        key = (msg.path, msg.step)
        if key in self._committed:
            return False
        have = self._parts.setdefault(key, set())
        have.update(msg.ranks)
        if len(have) < msg.world_size:
            return False
        del self._parts[key]
        self._committed[key] = None
        while len(self._committed) > self._remember:
            self._committed.pop(next(iter(self._committed)))
        return True

    def new_generation(self) -> None:
        """Workers restarted: parts saved by the previous generation never complete now."""
        self._parts.clear()
