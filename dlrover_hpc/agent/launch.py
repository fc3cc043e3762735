"""``dlrover-run``: find (or start) the master, then run the node's agent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

from dlrover_hpc import environ
from dlrover_hpc.agent import embedded
from dlrover_hpc.agent.agent import Agent, start_zygote
from dlrover_hpc.agent.zygote import Zygote
from dlrover_hpc.config import RunConfig, embedded_master_config, parse_host_port
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.jobdir import (
    MASTER_INFO,
    default_job_dir,
    load_master_info,
    make_job_dir,
    master_address,
    read_master_info,
    resolve_token,
)
from dlrover_hpc.master import cluster
from dlrover_hpc.master.thread import MasterThread

log = logging.getLogger(__name__)

MASTER_WAIT_S = 120.0


def find_master(job_dir: Path, *, timeout_s: float = MASTER_WAIT_S) -> tuple[str, int]:
    """``master.json`` in the job directory, written by the master step once it listens."""
    path = job_dir / MASTER_INFO
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return master_address(load_master_info(job_dir))
        except (FileNotFoundError, ValueError, KeyError):
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"no job master found: {path} did not appear within {timeout_s:.0f} s; "
                    "start 'dlrover-hpc master' first (the sbatch templates do), or pass "
                    f"--master HOST:PORT / set {environ.MASTER}"
                ) from None
            time.sleep(0.2)


def torchrun_habit(config: RunConfig) -> RunConfig:
    """``config``, run as ``--standalone`` when torchrun would: one node and nothing to join
    (no Slurm job, no --rdzv-endpoint, no --master, no live master.json).  A job of several
    nodes with no way to find its master fails at once, naming the flags that give one."""
    if config.standalone:
        return config
    job_dir = Path(config.job_dir or default_job_dir())
    master_given = config.master is not None or bool(os.environ.get(environ.MASTER))
    in_slurm = bool(os.environ.get("SLURM_JOB_ID"))
    what = embedded.without_master(
        nnodes_max=config.nnodes.max,
        master_given=master_given,
        in_slurm=in_slurm,
        endpoint=bool(config.rdzv_endpoint),
        live_master=not (master_given or in_slurm) and embedded.master_json_live(job_dir),
    )
    if what is embedded.Without.STANDALONE:
        log.info(
            "one node, no job master to join (no Slurm job, --rdzv-endpoint, --master or "
            "live %s): running as --standalone, as torchrun does",
            job_dir / MASTER_INFO,
        )
        return dataclasses.replace(config, standalone=True)
    if what is embedded.Without.FAIL:
        raise ConfigError(
            f"--nnodes={config.nnodes} needs a job master, and there is none to find: no Slurm "
            f"job (SLURM_JOB_ID), no --rdzv-endpoint, no --master or {environ.MASTER}, no live "
            f"{job_dir / MASTER_INFO}; run one node with --standalone, or give every node's "
            "dlrover-run the same --rdzv-endpoint=HOST:PORT (the agent on HOST hosts the master)"
        )
    return config


def run_agent(config: RunConfig) -> int:
    config = torchrun_habit(config)
    if config.standalone and not config.no_python:
        # This process hosts the master, whose stores are torch's: import torch here, first,
        # and the node's pre-warmed interpreter is a fork of this process (one `import torch`
        # on the node, not two: about 2 s of CPU and a few hundred MB less).
        with contextlib.suppress(ImportError):
            import torch.distributed  # noqa: F401
    zygote = start_zygote(config)
    if config.standalone:
        return _run_standalone(config, zygote)
    job_dir = make_job_dir(config.job_dir or default_job_dir())
    master = config.master
    if master is None and os.environ.get(environ.MASTER):
        master = parse_host_port(os.environ[environ.MASTER], flag=environ.MASTER)
    if master is None:
        embedded_plan = _embedded_plan(config, job_dir)
        if embedded_plan is not None:
            return _run_embedded(config, job_dir, embedded_plan, zygote)
        master = find_master(job_dir)
    token = resolve_token(job_dir, create=False)
    agent = Agent(config, master=master, token=token, job_dir=job_dir, zygote=zygote)
    return asyncio.run(agent.run())


#: Without --rdzv-endpoint, how long SLURM_PROCID 0 looks for a master step's master.json
#: before it embeds a master (the templates write it before any agent starts).
TEMPLATE_GRACE_S = 3.0


def _embedded_plan(config: RunConfig, job_dir: Path) -> embedded.Plan | None:
    """A plan to embed the master, or None to wait for a master step's ``master.json``."""
    if not config.rdzv_endpoint and not os.environ.get("SLURM_JOB_ID"):
        return None  # outside Slurm only an endpoint says who would host
    info = read_master_info(job_dir)
    if not config.rdzv_endpoint and info is None and os.environ.get("SLURM_PROCID", "0") == "0":
        time.sleep(TEMPLATE_GRACE_S)  # a master step starting at the same moment wins
        info = read_master_info(job_dir)
    on_job_node = not config.rdzv_endpoint or embedded.on_job_node(config.rdzv_endpoint, os.environ)
    if not on_job_node:
        log.warning(
            "--rdzv-endpoint=%s names none of this job's nodes (%s): the agent with "
            "SLURM_PROCID=0 hosts the job master and publishes it in master.json",
            config.rdzv_endpoint,
            os.environ.get("SLURM_JOB_NODELIST", ""),
        )
    return embedded.plan(
        endpoint=config.rdzv_endpoint,
        my_addresses=embedded.my_addresses(),
        env=os.environ,
        master_info=info,
        endpoint_on_job_node=on_job_node,
    )


def _run_embedded(
    config: RunConfig, job_dir: Path, plan: embedded.Plan, zygote: Zygote | None
) -> int:
    deadline = time.monotonic() + MASTER_WAIT_S
    if plan.host:
        token = resolve_token(job_dir, create=True)
        thread = MasterThread(
            embedded_master_config(
                config,
                host="0.0.0.0",
                port=plan.port,
                job_dir=str(job_dir),
                job_id=os.environ.get("SLURM_JOB_ID") or config.run_id or "embedded",
                requeue=False,
                embedded=True,
            ),
            token=token,
            job_dir=job_dir,
            cluster=cluster.from_env(),  # Slurm's parts when in a Slurm job
        )
        port = thread.start()
        if port:
            log.info("embedded job master listening port=%d job_dir=%s", port, job_dir)
            agent = Agent(
                config, master=("127.0.0.1", port), token=token, job_dir=job_dir, zygote=zygote
            )
            code = asyncio.run(agent.run())
            if code == 143:  # stopped by a signal (scancel, time limit): the job ends with it
                thread.stop("SIGTERM")
            thread.join(timeout_s=24 * 3600)  # it serves the other agents until the job ends
            return code
        if plan.endpoint is None:
            raise ConfigError("the embedded job master could not start (see the log above)")
        log.warning("could not listen on port %d; another agent hosts the master", plan.port)
    if plan.endpoint is not None:
        embedded.wait_reachable(*plan.endpoint, deadline=deadline, what="--rdzv-endpoint")
        master = plan.endpoint
    else:
        master = embedded.wait_master_json(job_dir, deadline=deadline)
    token = embedded.wait_token(job_dir, deadline=deadline)
    agent = Agent(config, master=master, token=token, job_dir=job_dir, zygote=zygote)
    return asyncio.run(agent.run())


def _run_standalone(config: RunConfig, zygote: Zygote | None) -> int:
    job_dir = make_job_dir(
        config.job_dir or os.path.join(os.getcwd(), ".dlrover-hpc", f"standalone-{os.getpid()}")
    )
    token = resolve_token(job_dir, create=True)  # 0600: `dlrover-hpc status|stacks` use it
    master = MasterThread(
        embedded_master_config(
            config,
            host="127.0.0.1",
            port=0,
            job_dir=str(job_dir),
            job_id=config.run_id or f"standalone-{os.getpid()}",
            last_call_s=0.0,
        ),
        token=token,
        job_dir=job_dir,
        cluster=cluster.from_env(),  # a standalone job in a Slurm allocation: Slurm's parts
    )
    port = master.start()
    agent = Agent(config, master=("127.0.0.1", port), token=token, job_dir=job_dir, zygote=zygote)
    code = asyncio.run(agent.run())
    master.join(timeout_s=10)
    return code
