"""What one probe reports: `ProbeResult`, and the JSON line that carries it from child to parent."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from dlrover_hpc.netcheck.model import NetcheckError


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeResult:
    """Outcome of one probe on one node. Times are seconds; None where the step did not run."""

    ok: bool
    matmul_s: float | None = None
    collective_s: float | None = None
    nccl_s: float | None = None
    device: str = "cpu"
    error: str = ""
    elapsed_s: float = 0.0
    #: the GPU link check's [src, dst, GB/s] rows (netcheck.gpu_links); () without CUDA
    gpu_links: tuple[tuple[str, str, float], ...] = ()

    @property
    def check_s(self) -> float | None:
        """The node's check time for the analysis: matmul plus collectives; None if it failed."""
        if not self.ok or self.matmul_s is None or self.collective_s is None:
            return None
        return self.matmul_s + self.collective_s + (self.nccl_s or 0.0)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise NetcheckError(f"probe output is not JSON ({e}): {text[:200]!r}") from e
        if not isinstance(data, dict):
            raise NetcheckError(f"probe output is not a JSON object: {text[:200]!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown or "ok" not in data:
            raise NetcheckError(
                f"probe output has unknown keys {sorted(unknown)!r} or lacks 'ok': {text[:200]!r}"
            )
        rows = data.get("gpu_links") or ()
        if not isinstance(rows, list | tuple) or not all(
            isinstance(r, list | tuple) and len(r) == 3 for r in rows
        ):
            raise NetcheckError(f"probe output's gpu_links is not [src, dst, gbps] rows: {rows!r}")
        data["gpu_links"] = tuple((str(r[0]), str(r[1]), float(r[2])) for r in rows)
        return cls(**data)
