"""A storage step read from the node-local tier (``--local-ckpt-dir``) when it holds it.

The ranks agree on a storage step as before (`restore_agreement`: commit records of the shared
directory).  Each rank then reads its part from its node's local tier when the tier holds that
save of the step (the same token as the commit record, every file the rank reads), else from
the shared directory; a local copy that does not load (missing, torn, failing disk) falls back
to the shared one with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from dlrover_hpc.checkpoint.saver.commit_records import CommitRecord
from dlrover_hpc.checkpoint.trainer.engine import Engine
from dlrover_hpc.checkpoint.trainer.restore_agreement import Load
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


def local_record(engine: Engine, record: CommitRecord) -> CommitRecord | None:
    """`record` pointing at the local tier's copy, when this rank's node holds that save."""
    tier = engine.local_tier
    if tier is None:
        return None
    try:
        held = tier.holds(step=record.step, token=record.token, rank=engine.env.rank)
    except OSError as exc:
        logger.warning("checkpoint local_tier_unreadable step=%d error=%s", record.step, exc)
        return None
    path = tier.local_path(engine.storage.path(record.path)) if held is not None else None
    return None if path is None else dataclasses.replace(record, path=path)


def prepare_tiered(
    engine: Engine,
    record: CommitRecord,
    from_storage: Callable[[CommitRecord], Load],
    local_reads: set[int],
) -> Load:
    """This rank's preparation of storage step `record.step`: from the local tier when it holds
    it (the step goes into `local_reads`), else from the shared directory."""
    local = local_record(engine, record)
    if local is not None:
        try:
            load = from_storage(local)
        except (OSError, CheckpointError) as exc:
            logger.warning(
                "checkpoint local_tier_unusable step=%d path=%s error=%s: reading the shared copy",
                record.step,
                local.path,
                exc,
            )
        else:
            local_reads.add(record.step)
            return load
    local_reads.discard(record.step)
    return from_storage(record)
