"""After a worker died: persist the newest complete in-memory step that storage lacks.

The agent calls this (through `SaverHost.persist_latest`) before it restarts the workers, so
a step that only lived in shared memory survives even when the whole job is then restarted
elsewhere.  The choice of steps is a pure function (`steps_to_persist`); the I/O goes through
the saver's persist queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from dlrover_hpc.checkpoint.saver.part_files import PartInfo
from dlrover_hpc.checkpoint.saver.persist_queue import SaverCore
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)

#: rank -> step -> (segment path, save token)
RankSteps = Mapping[int, Mapping[int, tuple[str, int]]]


def steps_to_persist(ranks: RankSteps, committed: int | None, *, limit: int = 2) -> list[int]:
    """Of the `limit` newest steps every rank holds and storage lacks (newest first), those
    every rank holds from one save.  Two, so nodes that disagree by one step still share a
    complete one."""
    if not ranks:
        return []
    common = set.intersection(*(set(steps) for steps in ranks.values()))
    chosen = [s for s in sorted(common, reverse=True) if committed is None or s > committed]
    # a step the ranks hold from different saves (tokens) is never combined
    return [s for s in chosen[:limit] if len({steps[s][1] for steps in ranks.values()}) == 1]


def persist_latest(core: SaverCore, paths: list[str], timeout_s: float) -> int | None:
    """Persists the newest step that every given segment's rank holds complete and that is
    not committed yet.  Returns the newest step made durable, or None."""
    deadline = time.monotonic() + timeout_s
    core.wait_idle(timeout_s)
    groups: dict[tuple[str, str], dict[int, dict[int, tuple[str, int]]]] = {}
    for path in paths:
        header = core.peek(path, deadline=min(deadline, time.monotonic() + 5.0))
        info = PartInfo.from_header(header) if header else None
        if header is None or info is None:
            continue
        steps = groups.setdefault((info.ckpt_dir, info.kind), {}).setdefault(info.rank, {})
        steps[header.step] = (path, info.token)
    newest: int | None = None
    for (ckpt_dir, _), ranks in groups.items():
        submitted = []
        for step in steps_to_persist(ranks, core.newest_committed(ckpt_dir)):
            try:
                for steps in ranks.values():
                    core.submit(steps[step][0], step=step)
                submitted.append(step)
            except CheckpointError as exc:
                logger.warning("checkpoint persist_latest_skipped step=%d error=%s", step, exc)
        core.wait_idle(max(0.0, deadline - time.monotonic()))
        for step in submitted:
            durable = all(
                core.is_durable(rank=rank, step=step, token=steps[step][1])
                for rank, steps in ranks.items()
            )
            if durable:
                newest = step if newest is None else max(newest, step)
                break
    return newest
