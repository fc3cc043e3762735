"""The agent's part in a network check: one probe, its result to the master."""

from __future__ import annotations

import asyncio
import logging
import os

from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.netcheck.launch import run_probe_subprocess
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)


async def run_probe(link: MasterLink, agent_id: str, a: m.Assignment) -> None:
    """One network-check probe with this round's partner(s); the result goes to the master."""
    result = await asyncio.to_thread(
        run_probe_subprocess,
        group_rank=a.group_rank,
        group_size=a.group_size,
        store_host=a.store_host,
        store_port=a.store_port,
        timeout_s=a.check_timeout_s,
        is_store_host=False,
        prefix=a.check_prefix,
        env=dict(os.environ),
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
