"""The node's flash-checkpoint saver, hosted by the agent, agreeing commits through the master."""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Sequence
from typing import Any

from dlrover_hpc import environ
from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.checkpoint.env import DEFAULT_SHM_DIR, current_user, segment_prefix
from dlrover_hpc.checkpoint.event_sinks import JsonlEventSink
from dlrover_hpc.checkpoint.saver.host import SaverHost
from dlrover_hpc.checkpoint.saver.replica_sender import ReplicaSender
from dlrover_hpc.checkpoint.saver.replicas import ReplicaServer
from dlrover_hpc.events import EventName
from dlrover_hpc.jobdir import local_user
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)


class MasterCommitCoordinator:
    """``part_durable`` asks the master, which counts every node's parts of a step; exactly
    one caller (the one completing the set) is told to commit.  Called from saver threads."""

    def __init__(self, client: MasterLink, loop: asyncio.AbstractEventLoop) -> None:
        self._client, self._loop = client, loop

    def part_durable(self, *, step: int, ranks: Sequence[int], world_size: int, path: str) -> bool:
        request = self._client.request(
            m.CheckpointPart(step=step, ranks=list(ranks), world_size=world_size, path=path),
            m.CheckpointCommit,
            timeout_s=60,
        )
        reply = asyncio.run_coroutine_threadsafe(request, self._loop).result(timeout=70)
        return reply.commit


class MasterEventSink:
    """Saver events go to the master, the one writer of events.jsonl."""

    def __init__(self, client: MasterLink, loop: asyncio.AbstractEventLoop, node: str) -> None:
        self._client, self._loop, self._node = client, loop, node

    def emit(self, event: EventName, **fields: Any) -> None:
        fields.setdefault("node", self._node)
        request = self._client.request(m.Event(event=event, fields=fields), m.Ack, timeout_s=30)
        try:
            asyncio.run_coroutine_threadsafe(request, self._loop).result(timeout=35)
        except Exception as exc:  # an event must never break a persist
            log.warning("event not delivered event=%s error=%s", event, exc)


def local_tier_env(local_dir: str) -> dict[str, str]:
    """What tells the workers of the node-local tier (they restore from it first)."""
    return {environ.LOCAL_CKPT_DIR: local_dir} if local_dir else {}


def saver_socket_path(job_id: str, node: str) -> str:
    """Names carry user, job and node, so two jobs on one node never collide."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{local_user()}-{job_id}-{node}")
    return os.path.join("/tmp", f"dlrover-hpc-{safe}.sock")[:107]


def start_replica_server(token: str, node: str) -> ReplicaServer:
    """Receives the parts other nodes copy here (``replica_count``); listens before the agent
    joins, so its port goes with the join.  The job's prefix is set once the job is known."""
    mem_mb = os.environ.get("SLURM_MEM_PER_NODE", "")
    server = ReplicaServer(
        shm_dir=DEFAULT_SHM_DIR,
        prefix="",
        token=token,
        host="0.0.0.0",
        mem_limit_bytes=int(mem_mb) << 20 if mem_mb.isdigit() and int(mem_mb) else None,
        node_name=node,
    )
    server.start()
    return server


def start_saver(
    client: MasterLink,
    *,
    job_id: str,
    node: str,
    token: str,
    replicas: ReplicaServer,
    events_path: str | None = None,
    local_dir: str = "",
) -> SaverHost:
    """``events_path``: the job's events.jsonl, where the node's ``checkpoint_saved`` lines go
    (one per step; the workers append there too, with O_APPEND); ``local_dir``: the node-local
    tier (``--local-ckpt-dir``; "": none)."""
    loop = asyncio.get_running_loop()
    events = MasterEventSink(client, loop, node)
    prefix = segment_prefix(user=current_user(), job_id=job_id, node_name=node)
    replicas.prefix = prefix  # nobody sends before this node's first round
    sender = ReplicaSender(
        shm_dir=DEFAULT_SHM_DIR, prefix=prefix, token=token, node_name=node, events=events
    )
    host = SaverHost(
        job_id=job_id,
        node_name=node,
        socket_path=saver_socket_path(job_id, node),
        commit=MasterCommitCoordinator(client, loop),
        events=events,
        replicas=sender,
        saved_events=JsonlEventSink(events_path, node=node) if events_path else None,
        local_dir=local_dir,
    )
    host.start()
    log.info("checkpoint saver listening socket=%s", host.socket_path)
    return host
