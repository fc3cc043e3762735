"""Subcommands that act on a running job: stop it for a continuation, change its batch size."""

from __future__ import annotations

import argparse

from dlrover_hpc import settings
from dlrover_hpc.config import env_default


def register_stop(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stop",
        help="end a running job at a step boundary: save, persist, continue in a new run",
        description="What the job script does on Slurm's --signal=B:USR1: the workers persist "
        "their first checkpoint save from a step the master picks, the job ends with "
        "time_limit_reached or job_preempted, and continues (scontrol requeue, else a "
        "resubmission) up to the master's --max-continuations.",
    )
    p.add_argument("--master", default=env_default(settings.MASTER), help="HOST:PORT")
    p.add_argument("--job-dir", default=env_default(settings.JOB_DIR), help="job directory")
    p.add_argument(
        "--kind",
        choices=["time_limit", "preempted"],
        default=None,
        help="what ends the job (default: the time limit when it is near, else preempted)",
    )
    p.add_argument("--reason", default="dlrover-hpc stop", help="said in the event log")
    p.set_defaults(func=_stop)


def _stop(args: argparse.Namespace) -> int:
    from dlrover_hpc.cli.status import request_stop

    kind = args.kind or ""
    return request_stop(master=args.master, job_dir=args.job_dir, kind=kind, reason=args.reason)


def register_batch_size(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "batch-size",
        help="change the micro batch size of a running job's ElasticDataLoader",
        description="Rewrite the job directory's paral_config.json (DLRover's parallelism "
        "config, which dlrover-run points the workers at): each ElasticDataLoader applies the "
        "new batch size after its next optimizer step; ElasticTrainer keeps the global batch.",
    )
    p.add_argument("batch_size", type=int, help="samples per micro-batch and rank")
    p.add_argument("--job-dir", default=env_default(settings.JOB_DIR), help="job directory")
    p.set_defaults(func=_batch_size)


def _batch_size(args: argparse.Namespace) -> int:
    from dlrover_hpc.cli.status import find_job_dir
    from dlrover_hpc.jobdir import write_batch_size

    job_dir = find_job_dir(args.job_dir)
    version = write_batch_size(job_dir, args.batch_size)
    print(f"batch size {args.batch_size} (config version {version}) in {job_dir}")
    return 0
