"""The node's worker processes: their environment (torchrun's variables), start, poll, stop."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

import psutil

from dlrover_hpc import environ, injections
from dlrover_hpc.agent.procs import LogSpec, ProcsResult, WorkerProcs
from dlrover_hpc.agent.zygote import (
    REQUEUE_BY_ENV,
    Zygote,
    exec_args,
    python_argv,
    run_args,
)
from dlrover_hpc.config import RunConfig
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.jobdir import PARAL_CONFIG, PARAL_CONFIG_ENV
from dlrover_hpc.protocol.messages import Assignment
from dlrover_hpc.slurm.env import worker_task_env
from dlrover_hpc.worker import membership, progress

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WorkerFailure:
    local_rank: int
    rank: int
    exit_code: int | None
    signal: str | None
    message: str
    error_file: str
    log_tail: str


def worker_env(
    config: RunConfig,
    assignment: Assignment,
    *,
    local_rank: int,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """torchrun's environment for one worker, plus dlrover-hpc's own variables; inside a Slurm
    job the task variables (``SLURM_PROCID`` ...) are rewritten to agree with it."""
    nproc = config.nproc_per_node
    rank = assignment.rank_offset + local_rank
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(assignment.world_size),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(assignment.node_rank),
        "GROUP_WORLD_SIZE": str(assignment.nnodes),
        "ROLE_NAME": config.role,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(assignment.world_size),
        "MASTER_ADDR": assignment.store_host,
        "MASTER_PORT": str(assignment.store_port),
        "TORCHELASTIC_RESTART_COUNT": str(assignment.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(assignment.max_restarts),
        "TORCHELASTIC_RUN_ID": config.run_id or assignment.run_id,
        environ.ROUND: str(assignment.round),  # the data-sharding client's incarnation
        REQUEUE_BY_ENV: config.requeue_by.value,  # is Slurm's USR1 the worker's to take?
        # Workers join the master's per-round store as clients (a fresh store each round).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "PYTHONUNBUFFERED": "1",
        **extra,
        **injections.worker_env(config.off),
    }
    if progress.PATH_ENV in extra:  # a template: one progress record per worker
        env[progress.PATH_ENV] = extra[progress.PATH_ENV].format(local_rank)
    if environ.JOB_DIR in extra and PARAL_CONFIG_ENV not in os.environ:
        # DLRover's parallelism config: ElasticDataLoader reads its batch size from it after
        # each optimizer step; `dlrover-hpc batch-size N` rewrites it during training.
        env[PARAL_CONFIG_ENV] = os.path.join(extra[environ.JOB_DIR], PARAL_CONFIG)
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default
    if config.virtual_local_rank:
        env.update(virtual_local_rank_env(local_rank, os.environ.get("CUDA_VISIBLE_DEVICES")))
    if injections.SLURM_ENV_REWRITE.name not in config.off:
        env.update(worker_task_env(os.environ, env))
    return env


def virtual_local_rank_env(local_rank: int, visible: str | None) -> dict[str, str]:
    """``--virtual-local-rank`` (torchrun's): the worker sees LOCAL_RANK=0 and only its own GPU,
    its entry of the agent's ``CUDA_VISIBLE_DEVICES``, else the GPU of its local rank."""
    if visible is None:
        return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(local_rank)}
    devices = visible.split(",")
    if local_rank >= len(devices):
        raise ConfigError(
            f"--virtual-local-rank: local rank {local_rank} has no GPU in "
            f"CUDA_VISIBLE_DEVICES={visible}; lower --nproc-per-node to {len(devices)} or "
            "make more GPUs visible"
        )
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": devices[local_rank].strip()}


class WorkerGroup:
    """Start, poll and stop this node's ``--nproc-per-node`` workers."""

    def __init__(
        self, config: RunConfig, *, log_dir: str | None, zygote: Zygote | None = None
    ) -> None:
        self.config = config
        self._zygote = zygote
        self._log_dir = log_dir
        self._ctx: WorkerProcs | None = None
        self._rank_offset = 0
        self.stderr_paths: dict[int, str] = {}

    def start(self, assignment: Assignment, extra_env: Mapping[str, str]) -> dict[int, int]:
        cfg = self.config
        argv = [cfg.training_script, *cfg.training_script_args]
        if self._zygote is not None and not cfg.no_python and self._zygote.ready(0.0):
            # Forked from a pre-warmed interpreter: no Python start-up, no `import torch`.
            worker_args = self._zygote.client_args(argv, module=cfg.module)
        elif cfg.no_python:
            worker_args = exec_args(argv)  # a shim that execs it
        elif injections.WORKER_HOOKS.name in cfg.off:
            # torchrun's own command line, exec'ed by a shim that sets it to die with the agent
            worker_args = exec_args(python_argv(argv, module=cfg.module))
        else:  # the zygote is not ready yet: run it as the zygote would, with the hooks
            worker_args = run_args(argv, module=cfg.module)
        # Both set the workers to die with this process, as this thread's children: this is
        # the event loop's thread, which lives as long as the agent (zygote.die_with_parent).
        args = {lr: worker_args for lr in range(cfg.nproc_per_node)}
        envs = {
            lr: worker_env(cfg, assignment, local_rank=lr, extra=extra_env)
            for lr in range(cfg.nproc_per_node)
        }
        ranks_filter = (
            {int(x) for x in cfg.local_ranks_filter.split(",") if x.strip()}
            if cfg.local_ranks_filter
            else None
        )
        run_log_dir = None
        if self._log_dir:
            run_log_dir = os.path.join(self._log_dir, f"round{assignment.round}")
            os.makedirs(run_log_dir, exist_ok=True)
        tee = cfg.tee
        if cfg.redirects == "0" and cfg.tee == "0":
            tee = "2"  # keep stderr on the console and in the log file, for diagnosis
        logs = LogSpec(
            log_dir=run_log_dir,
            redirects=cfg.redirects,
            tee=tee,
            local_ranks_filter=frozenset(ranks_filter) if ranks_filter is not None else None,
        )
        self._rank_offset = assignment.rank_offset
        for env in envs.values():
            if progress.PATH_ENV in env:  # a new process: no word of an earlier one's rounds
                membership.clear(env[progress.PATH_ENV])
        prefixes = {lr: f"[rank{assignment.rank_offset + lr}]:" for lr in range(cfg.nproc_per_node)}
        self._ctx = WorkerProcs(
            args={lr: [sys.executable, *a] for lr, a in args.items()},
            envs=envs,
            logs=logs,
            prefixes=prefixes,
            grace_s=cfg.shutdown_timeout_s,
        )
        self.stderr_paths = dict(self._ctx.stderrs)
        return self._pids("started", assignment)

    def _pids(self, how: str, assignment: Assignment) -> dict[int, int]:
        assert self._ctx is not None
        pids = dict(self._ctx.pids())
        log.info(
            "workers %s round=%d node_rank=%d pids=%s",
            how,
            assignment.round,
            assignment.node_rank,
            list(pids.values()),
        )
        return pids

    def kept_in_process(self, extra_env: Mapping[str, str]) -> bool:
        """Whether every worker runs the in-process wrapper (:mod:`..worker.membership`)."""
        if self._ctx is None or progress.PATH_ENV not in extra_env:
            return False
        for lr in range(self.config.nproc_per_node):
            record = extra_env[progress.PATH_ENV].format(lr)
            pid = membership.opted_in(record)
            reported = progress.read(record)  # the worker's pid: torch's may be a zygote client
            if pid is None or not psutil.pid_exists(pid):
                return False
            if reported is not None and reported.pid != pid:
                return False  # a new process that has not opted in (yet)
        return True

    def rejoin(self, assignment: Assignment, extra_env: Mapping[str, str]) -> dict[int, int]:
        """Tell the kept workers their place in ``assignment``'s round (they left the last)."""
        assert self._ctx is not None
        for lr in range(self.config.nproc_per_node):
            env = worker_env(self.config, assignment, local_rank=lr, extra=extra_env)
            notice = membership.Notice(assignment.round, membership.JOIN, env)
            membership.tell(env[progress.PATH_ENV], notice)
        self._rank_offset = assignment.rank_offset
        return self._pids("kept", assignment)

    def poll(self) -> ProcsResult | None:
        """None while running; the result once all exited or any failed (others stopped)."""
        assert self._ctx is not None
        return self._ctx.poll()

    def end(self, ranks: Sequence[int]) -> list[int]:
        """Stop those of ``ranks`` (global) that run here, counted as succeeded; their
        local ranks."""
        if self._ctx is None:
            return []
        local = [r - self._rank_offset for r in ranks]
        local = [lr for lr in local if 0 <= lr < self.config.nproc_per_node]
        self._ctx.end(local)
        return local

    def failures(self, result: ProcsResult) -> list[WorkerFailure]:
        """The failed workers, the likely cause first: a worker that died of its peers'
        death (a collective lost its connection) comes after one that died on its own."""
        out = []
        for local_rank, f in sorted(result.failures.items(), key=lambda kv: kv[1].timestamp):
            sig = f.signal_name() if f.exitcode < 0 else None
            tail = self.log_tail(local_rank)
            out.append(
                WorkerFailure(
                    local_rank=local_rank,
                    rank=self._rank_offset + local_rank,
                    exit_code=f.exitcode,
                    signal=sig,
                    message=f.message[:2000],
                    error_file=f.error_file,
                    log_tail=tail,
                )
            )
        # A worker whose collective lost a peer fails too: a consequence, not the cause.
        out.sort(key=lambda f: membership.PEER_LOST.search(f.log_tail + f.message) is not None)
        return out

    def log_tail(self, local_rank: int, max_bytes: int = 8192) -> str:
        path = self.stderr_paths.get(local_rank)
        if not path or not os.path.exists(path):
            return ""
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - max_bytes))
            return fh.read().decode(errors="replace")

    def stop(self) -> None:
        if self._ctx is not None:
            self._ctx.close(signal.SIGTERM, self.config.shutdown_timeout_s)
            self._ctx = None

    @property
    def running(self) -> bool:
        return self._ctx is not None
