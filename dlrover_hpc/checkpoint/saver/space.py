"""Warning while the storage under a checkpoint directory runs out of room."""

from __future__ import annotations

import logging
import shutil

from dlrover_hpc.checkpoint.api import EventSink
from dlrover_hpc.checkpoint.saver.part_files import PartInfo
from dlrover_hpc.checkpoint.saver.storage import Storage
from dlrover_hpc.events import EventName

logger = logging.getLogger(__name__)

#: Warn while the checkpoint storage has room for fewer than this many more checkpoints.
LOW_SPACE_CHECKPOINTS = 2


def check_space(
    storage: Storage,
    root: str,
    info: PartInfo,
    part_bytes: int,
    *,
    warned: set[str],
    events: EventSink | None,
    node: str,
) -> None:
    """A warning (log and ``checkpoint_storage_low``) when the storage under a local
    checkpoint directory has room for fewer than :data:`LOW_SPACE_CHECKPOINTS` more
    checkpoints of this size; once, until room returns."""
    if not storage.local:
        return  # an object store or a remote file system says nothing of its free space
    try:
        free = shutil.disk_usage(storage.path(root)).free
    except OSError:
        return
    need = part_bytes * info.parts  # the whole checkpoint, every rank's part
    if free >= LOW_SPACE_CHECKPOINTS * need:
        warned.discard(root)
        return
    if root in warned:
        return
    warned.add(root)
    retention = info.retention()
    fix = (
        "keep fewer checkpoints: keep_last=N or keep_interval=N on the checkpointer "
        "(DLRover's deletion_strategy=KeepLatestStepStrategy / KeepStepIntervalStrategy); "
        f"now keep_last={retention.get('keep_last')} "
        f"keep_interval={retention.get('keep_interval')}; or free space, or move the "
        "checkpoint directory to a larger file system"
    )
    logger.warning(
        "checkpoint storage_low dir=%s free_bytes=%d checkpoint_bytes=%d step=%d: room for "
        "fewer than %d more checkpoints; %s",
        root,
        free,
        need,
        info.step,
        LOW_SPACE_CHECKPOINTS,
        fix,
    )
    if events is not None:
        events.emit(
            EventName.CHECKPOINT_STORAGE_LOW,
            step=info.step,
            path=root,
            free_bytes=free,
            checkpoint_bytes=need,
            fix=fix,
            node=node,
        )
