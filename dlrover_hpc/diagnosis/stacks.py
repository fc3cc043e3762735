"""Python stacks of the workers: parsed, compared, and merged into one view (issue 13).

Stacks come from py-spy (``py-spy dump --json``) or, where the kernel forbids reading another
process's memory, from faulthandler's text.  Ranks whose main threads stand in the same frames
form one group; a hang shows as "ranks 0-6: all_reduce <- step <- train; rank 7: sleep <- ...":
the odd one out, or a process that is stopped, is the suspect.  Pure functions.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    function: str
    file: str
    line: int

    def short(self) -> str:
        return f"{self.function} ({self.file.rsplit('/', 1)[-1]}:{self.line})"


@dataclasses.dataclass(frozen=True, slots=True)
class Thread:
    name: str
    frames: tuple[Frame, ...]  # innermost first
    main: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Stack:
    threads: tuple[Thread, ...]

    def main_thread(self) -> Thread | None:
        return next((t for t in self.threads if t.main), self.threads[0] if self.threads else None)

    def signature(self) -> tuple[Frame, ...]:
        """What "the same place" means: the main thread's frames, lines included."""
        main = self.main_thread()
        return main.frames if main else ()

    def text(self) -> str:
        out = []
        for t in self.threads:
            out.append(f'Thread "{t.name}"{" (main)" if t.main else ""}:')
            out += [f"    {f.short()}" for f in t.frames] or ["    (no Python frames)"]
        return "\n".join(out)


def _launcher(frame: Frame) -> bool:
    return frame.file == "<frozen runpy>" or frame.file.endswith("dlrover_hpc/agent/zygote.py")


def _trim(frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """Without the outermost frames that only launched the script (runpy, the zygote)."""
    end = len(frames)
    while end > 1 and _launcher(frames[end - 1]):
        end -= 1
    return frames[:end]


def from_py_spy(data: Sequence[Mapping[str, Any]]) -> Stack:
    """``py-spy dump --json`` output (a list of threads)."""
    threads = []
    for t in data:
        frames = _trim(
            tuple(
                Frame(str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
                for f in t.get("frames", [])
            )
        )
        name = str(t.get("thread_name") or t.get("thread_id", "?"))
        threads.append(Thread(name, frames, main=name == "MainThread"))
    return Stack(tuple(threads))


_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def from_faulthandler(text: str) -> Stack:
    """One faulthandler dump (``Thread 0x...`` blocks); the thread that handled the signal,
    ``Current thread``, is the main one (Python runs signal handlers on the main thread)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            blocks.append([line])
        elif blocks and _FRAME.match(line):
            blocks[-1].append(line)
    threads = []
    for block in blocks:
        head = _THREAD.match(block[0])
        assert head is not None
        frames = []
        for line in block[1:]:
            mt = _FRAME.match(line)
            if mt:
                frames.append(Frame(mt.group(3), mt.group(1), int(mt.group(2))))
        main = head.group(1) == "Current thread"
        threads.append(Thread(head.group(2), _trim(tuple(frames)), main=main))
    return Stack(tuple(threads))


@dataclasses.dataclass(frozen=True, slots=True)
class RankStack:
    rank: int
    node: str
    pid: int
    status: str  # the process's state: running, sleeping, stopped, zombie, ... or "gone"
    stack: Stack | None  # None: it could not be read
    step: int = -1
    error: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    ranks: tuple[int, ...]
    where: str  # "innermost <- caller <- ..." of the main thread
    sample: RankStack


def to_json(stack: Stack | None) -> list[dict[str, Any]]:
    """The wire form (the agent sends it to the master)."""
    if stack is None:
        return []
    return [
        {"name": t.name, "main": t.main, "frames": [[f.function, f.file, f.line] for f in t.frames]}
        for t in stack.threads
    ]


def from_json(data: Sequence[Mapping[str, Any]]) -> Stack | None:
    if not data:
        return None
    return Stack(
        tuple(
            Thread(
                str(t["name"]),
                tuple(Frame(str(f[0]), str(f[1]), int(f[2])) for f in t["frames"]),
                bool(t["main"]),
            )
            for t in data
        )
    )


def where(stack: Stack | None, depth: int = 4) -> str:
    if stack is None:
        return "(stack unreadable)"
    frames = stack.signature()
    return " <- ".join(f.function for f in frames[:depth]) or "(no Python frames)"


def merge(ranks: Sequence[RankStack]) -> list[Group]:
    """Ranks grouped by identical main-thread stacks; the largest group first."""
    groups: dict[object, list[RankStack]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        key = r.stack.signature() if r.stack is not None else ("unreadable", r.error)
        groups.setdefault(key, []).append(r)
    out = [Group(tuple(x.rank for x in g), where(g[0].stack), g[0]) for g in groups.values()]
    return sorted(out, key=lambda g: (-len(g.ranks), g.ranks))


_ODD_STATUS = ("stopped", "tracing-stop", "zombie", "dead", "disk-sleep", "gone")


def suspect(ranks: Sequence[RankStack]) -> tuple[int, str] | None:
    """The rank most likely to hold the others up, and why; None when nothing stands out.

    A process that is stopped, dead or in uninterruptible sleep first; then the only rank
    whose stack differs from all the others'; then the rank with the oldest step."""
    for r in sorted(ranks, key=lambda r: r.rank):
        if r.status in _ODD_STATUS:
            return r.rank, f"its process is {r.status}"
    groups = merge(ranks)
    if len(groups) > 1 and len(groups[-1].ranks) == 1 and len(groups[0].ranks) > 1:
        odd = groups[-1]
        return odd.ranks[0], f"the only rank in {odd.where}; the others are in {groups[0].where}"
    stepped = [r for r in ranks if r.step >= 0]
    if len(stepped) > 1:
        low = min(stepped, key=lambda r: r.step)
        if sum(1 for r in stepped if r.step == low.step) == 1:
            return low.rank, f"the oldest step ({low.step})"
    return None


def ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def render(ranks: Sequence[RankStack], *, title: str = "") -> str:
    """The merged view: one block per group of identical stacks, the odd group first."""
    lines = [title] if title else []
    found = suspect(ranks)
    if found is not None:
        lines.append(f"suspect: rank {found[0]} ({found[1]})")
    node_of = {r.rank: r.node for r in ranks}
    for g in reversed(merge(ranks)):  # the odd group first, the largest last
        label = "rank" if len(g.ranks) == 1 else "ranks"
        # by rank, not `r.rank in g.ranks` over every rank: quadratic at 32,768 ranks (21 s)
        nodes = sorted({node_of[rank] for rank in g.ranks})
        lines.append("")
        lines.append(f"{label} {ranges(g.ranks)} on {','.join(nodes)}: {g.where}")
        body = g.sample.stack.text() if g.sample.stack else f"    ({g.sample.error})"
        lines += ["    " + line for line in body.splitlines()]
    return "\n".join(lines) + "\n"


def rank_text(r: RankStack) -> str:
    """One rank's file in a hang directory."""
    head = f"rank {r.rank} node {r.node} pid {r.pid} status {r.status} step {r.step}"
    body = r.stack.text() if r.stack is not None else f"(stack unreadable: {r.error})"
    return f"{head}\n{body}\n"


#: Long phases recognised from a stalled rank's main thread when no hook marked them (a
#: script that saves with ``torch.save`` or evaluates through a framework): (section, where).
#: Frames are matched by file path fragment or by function name.  A data loader is not among
#: them: a rank blocked in one mid-epoch is a hang (its start is marked by the hooks).
PHASE_FRAMES: tuple[tuple[str, str], ...] = (
    ("checkpoint", "torch/serialization.py"),
    ("checkpoint", "torch/distributed/checkpoint/"),
    ("checkpoint", "safetensors/"),
    ("checkpoint", "save_checkpoint"),
    ("checkpoint", "load_checkpoint"),
    ("checkpoint", "save_pretrained"),
    ("checkpoint", "_save_checkpoint"),
    ("eval", "evaluation_loop"),
    ("eval", "lightning/pytorch/loops/evaluation_loop.py"),
    ("eval", "lightning/pytorch/loops/prediction_loop.py"),
)


def phase_of(stack: Stack | None) -> str:
    """The long phase the main thread is in, by its frames (:data:`PHASE_FRAMES`), or ""."""
    main = stack.main_thread() if stack is not None else None
    if main is None:
        return ""
    for frame in main.frames:
        for phase, where in PHASE_FRAMES:
            if where in frame.file if "/" in where else where == frame.function:
                return phase
    return ""
