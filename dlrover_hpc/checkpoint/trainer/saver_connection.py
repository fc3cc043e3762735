"""How a training process reaches its saver: the agent's socket, or a saver thread of its own."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import time
import weakref
from datetime import timedelta
from typing import Any, Protocol

from dlrover_hpc.checkpoint.api import CommitCoordinator, EventSink, FaultHook
from dlrover_hpc.checkpoint.env import (
    ENV_SAVER_SOCKET,
    SEGMENT_PREFIX,
    WorkerEnv,
    local_ckpt_dir,
    safe_component,
)
from dlrover_hpc.checkpoint.saver.commits import CommitCounter, StoreCommitCoordinator
from dlrover_hpc.checkpoint.saver.persist_queue import SaverCore
from dlrover_hpc.checkpoint.saver.tier_writer import TierWriter
from dlrover_hpc.checkpoint.saver.worker_protocol import (
    MAX_TIMEOUT_S,
    Hello,
    Release,
    Replicate,
    Report,
    Saved,
    SaverClient,
    Wait,
)
from dlrover_hpc.errors import CheckpointError

logger = logging.getLogger(__name__)


class SaverLink(Protocol):
    """The saver as seen from a training process."""

    prefix: str
    shm_dir: str
    in_process: bool

    def submit(self, segment_path: str, step: int) -> None: ...

    def replicate(self, segment_path: str, step: int, count: int) -> None: ...

    def release(self, segment_path: str) -> bool: ...

    def wait_committed(
        self, ckpt_dir: str, step: int, timeout_s: float, rank: int, token: int
    ) -> bool: ...

    def close(self) -> None: ...


class SocketLink:
    """The agent's saver, over the socket named by `environ.SAVER_SOCKET`."""

    in_process = False

    def __init__(self, env: WorkerEnv, *, connect_timeout_s: float = 10.0) -> None:
        if not env.saver_socket:
            raise CheckpointError(f"{ENV_SAVER_SOCKET} is not set")
        self._client = SaverClient(env.saver_socket, connect_timeout_s=connect_timeout_s)
        reply = self._client.request(
            Hello(rank=env.rank, local_rank=env.local_rank, pid=os.getpid())
        )
        self.prefix = str(reply["prefix"])
        self.shm_dir = str(reply["shm_dir"])

    def submit(self, segment_path: str, step: int) -> None:
        name, where = os.path.basename(segment_path), os.path.dirname(segment_path)
        spilled = os.path.realpath(where) != os.path.realpath(self.shm_dir)
        self._client.request(Saved(segment=name, step=step, spilled=spilled))

    def replicate(self, segment_path: str, step: int, count: int) -> None:
        name = os.path.basename(segment_path)
        self._client.request(Replicate(segment=name, step=step, count=count))

    def release(self, segment_path: str) -> bool:
        """Asks the saver to unpin this buffer's queued step (superseded); False when it is
        being persisted, or the agent is older than this request."""
        try:
            reply = self._client.request(Release(segment=os.path.basename(segment_path)))
        except CheckpointError:
            return False
        return bool(reply.get("released"))

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
        """A save's ``checkpoint_saved``, for the saver's one line per node and step; raises
        CheckpointError when the saver does not write them (an older agent)."""
        self._client.request(
            Report(
                rank=rank,
                step=step,
                storage=storage,
                blocking_s=blocking_s,
                total_s=total_s,
                local_world=local_world,
            )
        )

    def wait_committed(
        self, ckpt_dir: str, step: int, timeout_s: float, rank: int, token: int
    ) -> bool:
        """Asks in waits of at most the saver's limit (a day): a stop notice's deadline is the
        job's time left, which may be longer (a job stopped by hand days before its limit)."""
        end = time.monotonic() + timeout_s
        while True:
            wait_s = min(max(end - time.monotonic(), 0.0), MAX_TIMEOUT_S)
            reply = self._client.request(
                Wait(ckpt_dir=ckpt_dir, step=step, rank=rank, token=token), timeout_s=wait_s
            )
            if reply.get("committed") or time.monotonic() >= end or wait_s < MAX_TIMEOUT_S:
                return bool(reply.get("committed"))

    def close(self) -> None:
        self._client.close()


class InProcessSaver:
    """A saver thread inside the training process (plain torchrun or a single process).

    Persists in flight are finished at interpreter exit; a crash of the process loses them.
    """

    in_process = True

    def __init__(
        self,
        env: WorkerEnv,
        *,
        commit: CommitCoordinator | None = None,
        events: EventSink | None = None,
        io_threads: int = 4,
        parts_span_ranks: bool = True,
        fault: FaultHook | None = None,
    ) -> None:
        self.prefix = env.prefix
        self.shm_dir = env.shm_dir
        if commit is None:
            if env.world_size > 1 and parts_span_ranks:
                store = store_coordinator_from_env()
                store.namespace = f"{env.generation_token():x}"
                commit = store
            else:
                commit = CommitCounter()
        self.commit = commit
        local_dir = local_ckpt_dir()
        self.core = SaverCore(
            commit=commit,
            events=events,
            node_name=env.node_name,
            io_threads=io_threads,
            fault=fault,
            tiers=TierWriter(local_dir, job=env.job_id, events=events, node_name=env.node_name)
            if local_dir
            else None,
        )
        self.core.start()
        self._closed = False
        self._warned_replicas = False
        sweep_stale_segments(env)
        ref = weakref.ref(self)
        atexit.register(_close_at_exit, ref)

    def submit(self, segment_path: str, step: int) -> None:
        self.core.submit(segment_path, step=step)

    def release(self, segment_path: str) -> bool:
        return self.core.release(segment_path)

    def replicate(self, segment_path: str, step: int, count: int) -> None:
        """No agents, no peers: a step lives in this node's memory and on storage only."""
        if not self._warned_replicas:
            self._warned_replicas = True
            logger.warning(
                "checkpoint replicas_unavailable count=%d: memory replicas on peer nodes need "
                "dlrover-run's agents; this process keeps its steps in its own memory only",
                count,
            )

    def wait_committed(
        self, ckpt_dir: str, step: int, timeout_s: float, rank: int, token: int
    ) -> bool:
        return self.core.wait_committed(ckpt_dir, step, timeout_s, rank=rank, token=token)

    def set_generation(self, token: int) -> None:
        if isinstance(self.commit, StoreCommitCoordinator):
            self.commit.namespace = f"{token:x}"

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.core.close()


def _close_at_exit(ref: Any) -> None:
    saver = ref()
    if saver is not None:
        saver.close()


_STANDALONE = re.compile(r"^standalone_(\d+)-")  # safe_component("standalone-<pid>")


def sweep_stale_segments(env: WorkerEnv) -> list[str]:
    """Removes our user's segments of standalone jobs whose launcher process is gone."""
    mine = f"{SEGMENT_PREFIX}{safe_component(env.user)}-"
    removed: list[str] = []
    try:
        names = os.listdir(env.shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(mine):
            continue
        m = _STANDALONE.match(name[len(mine) :])
        if not m or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(env.shm_dir, name))
            removed.append(name)
    if removed:
        logger.info("checkpoint stale_segments_removed count=%d", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def connect(
    env: WorkerEnv, *, events: EventSink | None, io_threads: int, parts_span_ranks: bool
) -> SaverLink:
    """The agent's saver if `environ.SAVER_SOCKET` is set, else an in-process one."""
    if env.saver_socket:
        try:
            return SocketLink(env)
        except CheckpointError as exc:
            logger.warning(
                "checkpoint agent_saver_unreachable socket=%s error=%s: using an in-process "
                "saver instead",
                env.saver_socket,
                exc,
            )
    else:
        logger.warning(
            "checkpoint: no agent saver (%s unset); persisting from a thread of this process, "
            "so a crash loses the persist in flight and memory restore works only within "
            "this node's process restarts; run under dlrover-run for agent-owned persistence",
            ENV_SAVER_SOCKET,
        )
    return InProcessSaver(
        env, events=events, io_threads=io_threads, parts_span_ranks=parts_span_ranks
    )


def store_coordinator_from_env(
    env: dict[str, str] | None = None, *, timeout_s: float = 30.0
) -> StoreCommitCoordinator:
    """Commit counting in torchrun's own TCPStore (``MASTER_ADDR``/``MASTER_PORT``)."""
    import torch.distributed as dist  # only in a training process (no agent saver)

    env = dict(os.environ) if env is None else env
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not host or not port:
        raise CheckpointError(
            "WORLD_SIZE > 1 but MASTER_ADDR/MASTER_PORT are not set; launch with torchrun "
            "or dlrover-run so the ranks can agree on committed checkpoints"
        )
    store = dist.TCPStore(
        host,
        int(port),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return StoreCommitCoordinator(store)
