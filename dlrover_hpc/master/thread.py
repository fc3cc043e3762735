"""An in-process master (``dlrover-run --standalone``, or an agent promoted to host the
job's master) on its own event-loop thread."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path

from dlrover_hpc.config import MasterConfig, RequeueBy
from dlrover_hpc.jobdir import make_job_dir, resolve_token
from dlrover_hpc.master import cluster, failover, stopping
from dlrover_hpc.master.assembly import build_master
from dlrover_hpc.master.cluster import Cluster
from dlrover_hpc.master.server import SUPERSEDED, MasterServer
from dlrover_hpc.protocol.loop import loop_factory

log = logging.getLogger(__name__)


class MasterThread:
    """An in-process master (``dlrover-run --standalone``) on its own event loop thread."""

    def __init__(
        self,
        config: MasterConfig,
        *,
        token: str,
        job_dir: Path,
        cluster: Cluster,
        epoch: int | None = None,
    ) -> None:
        # asyncio's own loop: this one runs on a daemon thread of the agent, and a uvloop loop
        # there ended the agent with SIGSEGV at its SIGTERM shutdown (1 of ~1,100 tests in CI).
        # uvloop serves the job master of its own process (run_master), where it pays.
        self._loop = asyncio.new_event_loop()
        master = build_master(config, cluster, job_dir=job_dir, epoch=epoch)
        self.server = MasterServer(master, token=token)
        self._ready = threading.Event()
        self.exit_code: int | None = None
        self._thread = threading.Thread(target=self._main, name="dlrover-hpc-master", daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def body() -> int:
            await self.server.start()
            self._ready.set()
            return await self.server.serve(linger_s=2.0)

        try:
            self.exit_code = self._loop.run_until_complete(body())
        except Exception:  # thread boundary
            log.exception("in-process master failed")
            self.exit_code = 1
        finally:
            self._ready.set()
            self._loop.close()

    def start(self) -> int:
        self._thread.start()
        self._ready.wait(30)
        return self.server.port

    def stop(self, reason: str) -> None:
        """End the job from another thread (the hosting agent was stopped by a signal)."""
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.server.master.job.request_stop, reason)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _framework_requeues(name: str) -> None:
    log.info("%s: left to the workers' framework (--requeue-by=framework)", name)


def run_master(config: MasterConfig) -> int:
    job_dir = make_job_dir(config.job_dir)
    token = resolve_token(job_dir, create=True)
    try:
        master = build_master(config, cluster.from_env(), job_dir=job_dir)
    except failover.MasterServing as exc:
        log.warning("not starting: %s", exc)
        return SUPERSEDED

    server = MasterServer(master, token=token)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        # The handlers only record the request; the job loop acts on it.
        loop.add_signal_handler(signal.SIGINT, master.job.request_stop, "SIGINT")
        tasks: set[asyncio.Task[None]] = set()

        def sigterm() -> None:  # Slurm's: a preemption or the time limit, unless cancelled
            task = loop.create_task(stopping.on_sigterm(master.stopper))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        loop.add_signal_handler(signal.SIGTERM, sigterm)
        # Slurm's --signal=USR1@T (without B:): save and continue before the time limit;
        # unless the workers' framework continues the job (it gets the signal from the agents).
        if config.requeue_by is RequeueBy.FRAMEWORK:
            loop.add_signal_handler(signal.SIGUSR1, _framework_requeues, "SIGUSR1")
        else:
            loop.add_signal_handler(signal.SIGUSR1, master.stopper.request, None, "SIGUSR1")
        return await server.serve()

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main())
