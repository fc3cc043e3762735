"""What a worker learns from its environment, and how shared-memory segments are named."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import socket
from collections.abc import Mapping

from dlrover_hpc import environ
from dlrover_hpc.errors import CheckpointError
from dlrover_hpc.jobdir import user_name

#: The agent's saver socket (the rest of what the agent sets is read through environ.WorkerEnv).
ENV_SAVER_SOCKET = environ.SAVER_SOCKET
#: Where segments live; `/dev/shm` unless set (e.g. a private `huge=always` tmpfs).
ENV_SHM_DIR = environ.SHM_DIR
DEFAULT_SHM_DIR = "/dev/shm"
#: Where a DISK save goes on its way to storage when shared memory has no room for it: a
#: disk-backed directory (`$TMPDIR`, else /var/tmp, which distributions keep on disk).
ENV_SPILL_DIR = environ.SPILL_DIR
SEGMENT_PREFIX = "dlrover-hpc-"
BUFFERS = ("a", "b")

_UNSAFE = re.compile(r"[^A-Za-z0-9_.]+")


def safe_component(value: str, *, limit: int = 48) -> str:
    """`value` made safe for a file name; long values keep a hash so they stay distinct."""
    cleaned = _UNSAFE.sub("_", value).strip("._") or "x"
    if len(cleaned) <= limit:
        return cleaned
    digest = hashlib.sha1(value.encode()).hexdigest()[:8]
    return f"{cleaned[: limit - 9]}_{digest}"


def local_ckpt_dir(env: Mapping[str, str] | None = None) -> str:
    """The node-local checkpoint tier (``--local-ckpt-dir``); "" when there is none."""
    return (os.environ if env is None else env).get(environ.LOCAL_CKPT_DIR, "")


def spill_dir() -> str:
    return os.environ.get(ENV_SPILL_DIR) or os.environ.get("TMPDIR") or "/var/tmp"


def current_user() -> str:
    """The segments' user (see :func:`dlrover_hpc.jobdir.user_name`)."""
    return user_name()


def segment_prefix(*, user: str, job_id: str, node_name: str) -> str:
    """`dlrover-hpc-<user>-<job>-<node>-`: two jobs (or users) on one node never collide."""
    parts = (safe_component(user), safe_component(job_id), safe_component(node_name))
    return SEGMENT_PREFIX + "-".join(parts) + "-"


def segment_name(prefix: str, *, rank: int, buffer: int, tag: str = "") -> str:
    suffix = f"-{safe_component(tag, limit=16)}" if tag else ""
    return f"{prefix}r{rank}{suffix}-{BUFFERS[buffer]}"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CheckpointError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerEnv:
    """A worker's identity, read once from torchrun's and the agent's variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    job_id: str
    node_name: str
    user: str
    saver_socket: str | None
    job_dir: str | None
    shm_dir: str
    run_id: str
    restart_count: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise CheckpointError(
                f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}; "
                "launch with torchrun or dlrover-run, or unset both"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise CheckpointError(
                f"LOCAL_RANK={self.local_rank} is outside LOCAL_WORLD_SIZE={self.local_world_size}"
            )

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        env = os.environ if env is None else env
        agent = environ.WorkerEnv.from_environ(env)  # what dlrover-run told the worker
        world = _int(env, "WORLD_SIZE", 1)
        job = agent.job_id or env.get("SLURM_JOB_ID") or f"standalone-{os.getppid()}"
        node = agent.node_name or env.get("SLURMD_NODENAME") or socket.gethostname()
        return cls(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=world,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            group_rank=_int(env, "GROUP_RANK", 0),
            job_id=job,
            node_name=node.split(".")[0],
            user=current_user(),
            saver_socket=agent.saver_socket,
            job_dir=agent.job_dir,
            shm_dir=env.get(ENV_SHM_DIR) or DEFAULT_SHM_DIR,
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        )

    @property
    def prefix(self) -> str:
        return segment_prefix(user=self.user, job_id=self.job_id, node_name=self.node_name)

    def generation_token(self) -> int:
        """A token all ranks of one worker-group incarnation share (agreed again at load).

        With several ranks it must be derivable by each of them: run id and restart count.
        A single process needs no agreement and takes a fresh one per process.
        """
        if self.world_size == 1:
            return int.from_bytes(os.urandom(7), "big")
        text = f"{self.run_id or self.job_id}/{self.restart_count}"
        return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big")
