"""The values of a network check: groups, what each group and round reported, the verdict.

Group and round reports are validated at construction (`NetcheckError` says what is wrong with
which group), so the planning and analysis can trust them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from dlrover_hpc.errors import DlroverHpcError

Group = tuple[str, ...]


class NetcheckError(DlroverHpcError):
    """A network-check plan or result is malformed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """What one group reported for one round.

    `elapsed_s` maps a member to its check time (matmul plus collectives); members of a failed
    group usually have none. The mapping is copied at construction.
    """

    nodes: Group
    ok: bool
    elapsed_s: Mapping[str, float] = field(default_factory=dict)
    error: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "elapsed_s", dict(self.elapsed_s))
        if len(self.nodes) < 2:
            raise NetcheckError(
                f"group {list(self.nodes)!r} has {len(self.nodes)} node(s); "
                "a network-check group needs at least 2 nodes"
            )
        if len(set(self.nodes)) != len(self.nodes):
            raise NetcheckError(f"group {list(self.nodes)!r} names a node twice")
        for node, seconds in self.elapsed_s.items():
            if node not in self.nodes:
                raise NetcheckError(
                    f"group {list(self.nodes)!r} reports a time for {node!r}, "
                    "which is not a member of the group"
                )
            if not (math.isfinite(seconds) and seconds >= 0.0):
                raise NetcheckError(
                    f"group {list(self.nodes)!r}: elapsed_s[{node!r}] = {seconds!r}; "
                    "expected a finite number of seconds >= 0"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundResult:
    """All groups of one round; a node appears in at most one group per round."""

    round_index: int
    groups: tuple[GroupResult, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        seen: dict[str, Group] = {}
        for group in self.groups:
            for node in group.nodes:
                if node in seen:
                    raise NetcheckError(
                        f"round {self.round_index}: node {node!r} is in group "
                        f"{list(seen[node])!r} and in group {list(group.nodes)!r}; "
                        "a node runs one probe per round"
                    )
                seen[node] = group.nodes


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckVerdict:
    """The analysis of the rounds so far.

    `faulty` and `stragglers` are final only when `needs_another_round` is False. `unresolved`
    nodes could not be told apart within the rounds allowed; they are not blamed, the caller
    decides (retry the check, or exclude them). `unexplained_failures` are failed groups whose
    members all passed elsewhere (a flaky link between two working nodes): no node is blamed.
    """

    faulty: frozenset[str]
    stragglers: frozenset[str]
    healthy: frozenset[str]
    unresolved: frozenset[str]
    needs_another_round: bool
    rounds_used: int
    timings_s: Mapping[str, float]
    median_s: float | None
    unexplained_failures: tuple[Group, ...] = ()
