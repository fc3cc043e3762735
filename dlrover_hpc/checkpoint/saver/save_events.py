"""``checkpoint_saved`` once per node and step, not once per rank (issue 29).

Every rank of a node saves every checkpoint: one line per rank is 8 lines per node and save,
32,768 per save at 4,096 nodes.  Under an agent the workers report their saves to the node's
saver (the ``report`` request) and this writes one line per node and step: the ranks, the
longest blocking and total seconds (the job waits for its slowest rank, so the goodput report
stays exact) and the median.  A rank whose blocking stands out (over twice the median and
:data:`OUTLIER_EXTRA_S` more) also gets its own line, with its rank.  A step's line is written
once every rank connected to the saver reported it, or :data:`FLUSH_S` after the first report
(a rank died before its save), with the time of the first report; "every rank" is the node's
local world size as its ranks report it, or the workers connected to the saver, the larger.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import threading
import time
from collections.abc import Callable

from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)

FLUSH_S = 5.0
OUTLIER_FACTOR, OUTLIER_EXTRA_S = 2.0, 0.05
STORAGES = frozenset({"memory", "disk"})


@dataclasses.dataclass(slots=True)
class _Step:
    first_at: float  # wall clock of the first report
    started: float  # monotonic, for the flush
    storage: str
    expected: int = 0  # the node's ranks, as its ranks reported them
    ranks: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)


class SavedEvents:
    """Collects the ranks' reports of each step; ``emit`` writes the events (thread-safe)."""

    def __init__(
        self,
        emit: Callable[..., None],
        *,
        expected: Callable[[], int],
        flush_s: float = FLUSH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit, self._expected, self._flush_s, self._clock = emit, expected, flush_s, clock
        self._steps: dict[int, _Step] = {}
        self._lock = threading.Lock()

    def report(
        self,
        *,
        rank: int,
        step: int,
        storage: str,
        blocking_s: float,
        total_s: float,
        local_world: int = 0,
    ) -> None:
        """One rank saved ``step``; ``local_world``: the node's ranks, as the rank knows them
        (0: unknown, the saver's connected workers count).  Raises CheckpointError on a field
        that makes no sense."""
        try:
            rank, step, local_world = int(rank), int(step), int(local_world)
            blocking_s, total_s = float(blocking_s), float(total_s)
        except (TypeError, ValueError, OverflowError) as exc:
            raise CheckpointError(f"bad report: {exc}") from None
        if rank < 0 or step < 0 or storage not in STORAGES or not 0 <= local_world <= 1 << 16:
            raise CheckpointError(f"bad report: rank {rank}, step {step}, storage {storage!r}")
        if not all(math.isfinite(s) and 0 <= s <= 86400 for s in (blocking_s, total_s)):
            raise CheckpointError(f"bad report: blocking_s {blocking_s}, total_s {total_s}")
        with self._lock:
            entry = self._steps.get(step)
            if entry is None:
                entry = self._steps[step] = _Step(time.time(), self._clock(), storage)
            entry.ranks[rank] = (blocking_s, total_s)
            entry.expected = max(entry.expected, local_world)
            done = [step] if len(entry.ranks) >= max(1, entry.expected, self._expected()) else []
            done += [s for s, e in self._steps.items() if s != step and self._stale(e)]
            ready = [(s, self._steps.pop(s)) for s in sorted(set(done))]
        for s, e in ready:
            self._write(s, e)

    def flush(self, *, everything: bool = False) -> None:
        """Writes the steps whose ranks did not all report within the flush time (all of them
        with ``everything``: the saver is closing)."""
        with self._lock:
            stale = [s for s, e in self._steps.items() if everything or self._stale(e)]
            ready = [(s, self._steps.pop(s)) for s in sorted(stale)]
        for s, e in ready:
            self._write(s, e)

    def _stale(self, entry: _Step) -> bool:
        return self._clock() - entry.started >= self._flush_s

    def _write(self, step: int, entry: _Step) -> None:
        blocking = [b for b, _ in entry.ranks.values()]
        median = statistics.median(blocking)
        try:
            self._emit(
                EventName.CHECKPOINT_SAVED,
                time=entry.first_at,
                step=step,
                storage=entry.storage,
                ranks=sorted(entry.ranks),
                blocking_s=round(max(blocking), 6),
                total_s=round(max(t for _, t in entry.ranks.values()), 6),
                blocking_median_s=round(median, 6),
            )
            for rank, (b, t) in sorted(entry.ranks.items()):
                if b > OUTLIER_FACTOR * median and b > median + OUTLIER_EXTRA_S:
                    self._emit(
                        EventName.CHECKPOINT_SAVED,
                        time=entry.first_at,
                        step=step,
                        storage=entry.storage,
                        rank=rank,
                        blocking_s=round(b, 6),
                        total_s=round(t, 6),
                        outlier=True,
                    )
        except Exception as exc:  # an event must never break a save
            logger.warning("checkpoint saved_event_failed step=%d error=%s", step, exc)
