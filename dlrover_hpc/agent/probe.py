"""The agent's part in a network check: one probe, its result to the master."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time

from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.agent.zygote import Zygote
from dlrover_hpc.netcheck.launch import run_probe_subprocess
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)


#: At most this share of a probe's budget is spent waiting for the zygote to finish its
#: ``import torch`` (it started with the agent); past it, the probe starts an interpreter. The
#: probe itself needs a few seconds of the rest. Waiting is the cheaper way for the node: a probe
#: of its own imports torch a second time beside the zygote, and at a job's start, on a busy
#: host, the two imports together outlasted the whole budget (every probe of a check's first
#: round failed at its store connection; 0.25 of the budget, at most 5 s, was waited then).
ZYGOTE_SHARE = 0.6


async def run_probe(
    link: MasterLink, agent_id: str, a: m.Assignment, zygote: Zygote | None = None
) -> None:
    """One network-check probe with this round's partner(s); the result goes to the master.
    The probe is a fork of the agent's zygote when it is ready: each probe would otherwise
    import torch afresh (about 2 s of CPU, twice per node and check)."""
    runner: tuple[str, ...] = ()
    started = time.monotonic()
    if zygote is not None:
        wait_s = ZYGOTE_SHARE * a.check_timeout_s
        with contextlib.suppress(OSError, ValueError):  # it stopped meanwhile
            if await asyncio.to_thread(zygote.ready, wait_s):
                runner = (sys.executable, *zygote.client_args([], module=True))
    result = await asyncio.to_thread(
        run_probe_subprocess,
        group_rank=a.group_rank,
        group_size=a.group_size,
        store_host=a.store_host,
        store_port=a.store_port,
        timeout_s=a.check_timeout_s - (time.monotonic() - started),
        is_store_host=False,
        prefix=a.check_prefix,
        env=dict(os.environ),
        runner=runner,
    )
    log.info(
        "network probe round=%d ok=%s check_s=%s error=%s",
        a.check_round,
        result.ok,
        result.check_s,
        result.error,
    )
    await link.request(
        m.NetcheckReport(
            agent_id=agent_id,
            check_round=a.check_round,
            ok=result.ok,
            check_s=result.check_s,
            error=result.error[:500],
        ),
        m.Ack,
        timeout_s=30,
    )
