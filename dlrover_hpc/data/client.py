"""Dynamic data sharding, the training process's side: ask the job master for shards.

Under ``dlrover-run`` each rank makes a :class:`ShardingClient` (or the sampler of
:mod:`dlrover_hpc.data.sampler`) and reads the sample indices it yields; the master hands out
shards until every sample of every epoch is trained or being trained.  A worker that fails or a
node that is lost leaves its unfinished shards behind; the next round gets them.  The one thing
the script must tell the client is ``start_batch``: how many batches each rank had drawn at
the checkpoint it resumed from (0 for a fresh start) — with one batch per step, the step.

The client talks to the master on its usual port, with the job's token, from a small thread of
its own, and finds a restarted or promoted master through the job directory's ``master.json``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from dlrover_hpc import environ, jobdir
from dlrover_hpc.config import parse_host_port
from dlrover_hpc.errors import DlroverHpcError, UsageError
from dlrover_hpc.jobdir import load_master_info, master_address
from dlrover_hpc.protocol import messages as m
from dlrover_hpc.protocol.client import MasterClient

log = logging.getLogger(__name__)
RETRY_S = 120.0  # how long a request is retried while the master restarts or moves


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    epoch: int
    start: int  # positions [start, end) of the epoch's order
    end: int


class ShardingClient:
    def __init__(
        self,
        dataset_name: str,
        dataset_size: int,
        *,
        batch_size: int,
        shard_size: int | None = None,
        num_epochs: int = 1,
        start_batch: int = 0,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        if dataset_size < 1 or batch_size < 1 or num_epochs < 1 or start_batch < 0:
            raise UsageError(
                f"dataset_size={dataset_size}, batch_size={batch_size}, num_epochs={num_epochs} "
                f"must be at least 1 and start_batch={start_batch} at least 0"
            )
        self.name, self.size, self.batch_size = dataset_name, dataset_size, batch_size
        self.shard_size = shard_size or batch_size * 16
        self.epochs, self.start_batch = num_epochs, start_batch
        self.shuffle, self.seed = shuffle, seed
        env = os.environ
        missing = [k for k in (environ.MASTER, environ.ROUND, "RANK") if k not in env]
        if missing:
            raise UsageError(
                f"dynamic data sharding needs the job master: {', '.join(missing)} not set; run "
                "the script with dlrover-run"
            )
        self.round, self.rank = int(env[environ.ROUND]), int(env["RANK"])
        self._master = parse_host_port(env[environ.MASTER], flag=environ.MASTER)
        self._job_dir = Path(env.get(environ.JOB_DIR, "."))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="shards")
        self._thread.start()
        self._client: MasterClient | None = None
        self._orders: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ shards
    def fetch_shard(self) -> Shard | None:
        """The next shard; None when the dataset has nothing left for this rank."""
        msg = m.ShardRequest(
            dataset=self.name,
            size=self.size,
            shard_size=self.shard_size,
            epochs=self.epochs,
            round=self.round,
            rank=self.rank,
            start=self.start_batch,
            batch_size=self.batch_size,
        )
        reply = asyncio.run_coroutine_threadsafe(self._ask(msg), self._loop).result()
        if reply.epoch < 0:
            return None
        return Shard(reply.epoch, reply.start, reply.end)

    def indices(self) -> Iterator[int]:
        """Every sample index this rank is to train, shard by shard, until none is left."""
        while (shard := self.fetch_shard()) is not None:
            order = self._order(shard.epoch)
            for position in range(shard.start, shard.end):
                yield order[position] if order else position

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return []
        if epoch not in self._orders:
            order = list(range(self.size))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time in memory
        return self._orders[epoch]

    # ------------------------------------------------------------------ the master
    async def _ask(self, msg: m.ShardRequest) -> m.ShardReply:
        deadline = time.monotonic() + RETRY_S
        delay = 0.25
        while True:
            try:
                if self._client is None or self._client.closed.is_set():
                    self._client = await MasterClient.connect(
                        *self._master, token=_token(self._job_dir), timeout_s=10.0
                    )
                return await self._client.request(msg, m.ShardReply, timeout_s=30.0)
            except (OSError, TimeoutError, ConnectionError) as exc:
                if time.monotonic() > deadline:
                    raise DlroverHpcError(
                        f"no job master answered shard requests for {RETRY_S:.0f} s "
                        f"({exc}); is the job still running?"
                    ) from None
                self._client = None
                self._master = _newest_master(self._job_dir, self._master)
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    def close(self) -> None:
        if self._client is not None:
            client = self._client
            asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


def _token(job_dir: Path) -> str:
    token = os.environ.get(environ.TOKEN, "")
    if token:
        return token
    try:
        return (job_dir / jobdir.TOKEN).read_text().strip()
    except OSError as exc:
        raise DlroverHpcError(
            f"cannot read the job token {job_dir / jobdir.TOKEN} ({exc.strerror}); run the script "
            "with dlrover-run as the job's user"
        ) from None


def _newest_master(job_dir: Path, current: tuple[str, int]) -> tuple[str, int]:
    """``master.json``'s address (a restarted or promoted master), else ``current``."""
    try:
        return master_address(load_master_info(job_dir))
    except (OSError, ValueError, KeyError, TypeError):
        return current
