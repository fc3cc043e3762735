"""The hostfile of ``dlrover-hpc launch``: one host per line, optional ``slots=N``.

::

    # comments start with '#', here or after a host
    node01 slots=8      # 8 workers on node01 (default: dlrover-run's --nproc-per-node)
    node[02-04,07]      # Slurm hostlist ranges, expanded in order
    10.0.0.12 slots=4

Hosts are used in file order: the first ones are active, the last ones hot spares.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import hostlist

from dlrover_hpc.ssh.errors import HostfileError

HOSTLIST_EXAMPLE = "node[01-04,07]"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HostEntry:
    """One host of the hostfile; ``slots`` is its worker count (None: the run's default)."""

    name: str
    slots: int | None = None
    line: int = 0


def load_hostfile(path: str | Path) -> list[HostEntry]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise HostfileError(f"{path}: no such hostfile; pass --hostfile FILE") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(f"{path}: cannot read the hostfile ({exc})") from None
    return parse_hostfile(text, source=str(path))


def parse_hostfile(text: str, *, source: str = "hostfile") -> list[HostEntry]:
    """Parse a hostfile; raises :class:`HostfileError` naming the file, line and the fix."""
    hosts: list[HostEntry] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{source}:{number}"
        slots = _parse_options(words[1:], where=where)
        for name in _expand(words[0], where=where):
            if name in seen:
                raise HostfileError(
                    f"{where}: host '{name}' is already listed on line {seen[name]}; "
                    "list each host once"
                )
            seen[name] = number
            hosts.append(HostEntry(name=name, slots=slots, line=number))
    if not hosts:
        raise HostfileError(
            f"{source}: no hosts; write one host per line, e.g. 'node01 slots=8' or "
            f"'{HOSTLIST_EXAMPLE}'"
        )
    return hosts


def _expand(word: str, *, where: str) -> list[str]:
    if "=" in word:
        raise HostfileError(f"{where}: '{word}' comes before any host; write HOST [slots=N]")
    if "@" in word:
        raise HostfileError(
            f"{where}: '{word}': user names do not go in the hostfile; use --ssh-user or a "
            "'User' line in ~/.ssh/config"
        )
    if ":" in word and "[" not in word:
        host, _, count = word.rpartition(":")
        hint = f"'{host} slots={count}'" if count.isdigit() else f"'{host}' (HOST [slots=N])"
        raise HostfileError(
            f"{where}: '{word}': write the worker count as slots=N, e.g. {hint}; "
            "an SSH port goes in ~/.ssh/config"
        )
    try:
        names = list(hostlist.expand_hostlist(word, sort=False))
    except hostlist.BadHostlist as exc:
        raise HostfileError(
            f"{where}: '{word}' is not a valid host list ({exc}); write e.g. {HOSTLIST_EXAMPLE}"
        ) from None
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise HostfileError(f"{where}: '{word}' names host '{dup}' twice; list each host once")
    return names


def _parse_options(words: list[str], *, where: str) -> int | None:
    slots: int | None = None
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise HostfileError(
                f"{where}: unexpected '{word}'; write one host (or host list) per line: "
                "HOST [slots=N]"
            )
        if key != "slots":
            raise HostfileError(f"{where}: unknown key '{key}'; only slots=N may follow the host")
        if slots is not None:
            raise HostfileError(f"{where}: slots= is given twice; keep one")
        if not value.isdigit() or int(value) < 1:
            raise HostfileError(
                f"{where}: slots={value}: expected a positive number of workers, e.g. slots=8"
            )
        slots = int(value)
    return slots
