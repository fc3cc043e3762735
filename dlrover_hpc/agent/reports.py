"""What an agent tells the master about its workers' failures."""

from __future__ import annotations

from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.diagnosis.classify import Diagnosis
from dlrover_hpc.protocol import messages as m


async def report_failure(
    link: MasterLink | None,
    agent_id: str,
    a: m.Assignment,
    local_rank: int,
    diagnosis: Diagnosis,
    *,
    exit_code: int | None = None,
    signal: str | None = None,
    progress: list[m.RankProgress] | None = None,
) -> None:
    """A worker of round ``a`` failed (``exit_code``/``signal``: None for a fault found only
    in its log), with the diagnosis and its evidence, and the node's ranks' last steps."""
    assert link is not None
    await link.request(
        m.WorkerFailed(
            agent_id=agent_id,
            round=a.round,
            local_rank=local_rank,
            rank=a.rank_offset + local_rank,
            exit_code=exit_code,
            signal=signal,
            classification=diagnosis.kind.value,
            reason=f"{diagnosis.reason} [{'; '.join(diagnosis.evidence)[:600]}]",
            progress=progress or [],
            rule=diagnosis.rule,
        ),
        m.Ack,
        timeout_s=30,
    )
