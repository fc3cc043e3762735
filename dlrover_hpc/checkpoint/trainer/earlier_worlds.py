"""Segments that ranks of an earlier world left on this node, and when they may go."""

from __future__ import annotations

import logging
import os
from typing import Any, Protocol

from dlrover_hpc.checkpoint.api import PartKind
from dlrover_hpc.checkpoint.env import WorkerEnv
from dlrover_hpc.checkpoint.saver.segments import Segment, list_segments

logger = logging.getLogger(__name__)


class Leader(Protocol):
    """What of a checkpointer's engine the node leader's clean-up reads (and one flag)."""

    env: WorkerEnv
    kind: PartKind
    link: Any
    buffers: Any
    no_earlier_world: bool

    def segment_path(self, buffer: int, *, rank: int | None = None) -> str: ...


def drop_earlier_worlds(engine: Leader) -> list[str]:
    """Removes this node's segments that ranks of an earlier world saved here (names of
    ranks not on this node now), once the node leader's two buffers both hold newer
    steps: a restore takes the newest step whose parts survive, so they would serve only
    if this world's saves had failed twice (storage then).  Until then they may be all
    that holds the last step in memory; after that they would only fill the node's
    memory and hide this node's current steps from the agent's persist-on-failure."""
    if engine.env.local_rank != 0 or engine.no_earlier_world:
        return []
    width = 1 if engine.kind == PartKind.DDP else engine.env.local_world_size  # who writes
    here = range(engine.env.rank, engine.env.rank + width)
    earlier = [
        name
        for name in list_segments(engine.link.shm_dir, engine.link.prefix)
        if name.rank not in here and name.path == engine.segment_path(name.buffer, rank=name.rank)
    ]
    engine.no_earlier_world = not earlier  # none appear later in this world: stop looking
    own = [seg.header() if seg is not None else None for seg in engine.buffers.segments]
    if not earlier or None in own:
        return []
    oldest = min(h.step for h in own if h is not None)
    removed = []
    for name in earlier:
        try:
            seg = Segment(name.path, writable=False)
            try:
                header = seg.header()
            finally:
                seg.close()
            if header is None or header.step < oldest:
                os.unlink(name.path)
                removed.append(name.path)
        except OSError as exc:  # gone already, or not ours
            logger.debug("checkpoint drop_segment_skipped path=%s error=%s", name.path, exc)
    if removed:
        logger.info("checkpoint earlier_world_segments_removed count=%d", len(removed))
    return removed
