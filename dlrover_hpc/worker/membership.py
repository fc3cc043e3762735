"""How an agent tells workers that keep their processes about a membership change (issue 26).

A worker whose training function runs under :func:`dlrover_hpc.trainer.inprocess.wrap` does
not have to die when the job's membership changes (a node lost, a node joining, a worker of
another node dead): it leaves the round's process group, waits, and joins the next round in
the same process.  The agent and the worker talk through three small files beside the
worker's progress record (node-local, ``/dev/shm``):

- ``<record>.inprocess``: the worker's pid, written once by the wrapper: this process can
  change rounds in-process;
- ``<record>.round``: written by the agent, atomically (a rename), one JSON object: ``leave``
  (a round numbered ``round`` or later is coming: leave this round's process group now) or
  ``join`` (round ``round`` is formed; ``env`` is the worker's environment in it: ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ...);
- ``<record>.left``: the round the worker has left, written by the worker once its process
  group is torn down.  An agent that does not see it in time ends the worker and starts a
  new one (a stopped or deadlocked rank never acknowledges);
- ``<record>.broken``: a collective of the worker's round lost a peer (JSON: the round, the
  error).  A kept worker does not die of it, so without this word the master would learn of
  the change only from the lost node itself (after a reconnect grace); the agent reports it
  as a peer-lost failure, and the round re-forms at once.

Nothing here imports torch: the agent uses it as well as the worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re

OPT_IN_SUFFIX, NOTICE_SUFFIX, LEFT_SUFFIX = ".inprocess", ".round", ".left"
BROKEN_SUFFIX = ".broken"
SUFFIXES = (OPT_IN_SUFFIX, NOTICE_SUFFIX, LEFT_SUFFIX, BROKEN_SUFFIX)
LEAVE, JOIN = "leave", "join"
#: What a collective that lost a peer raises (gloo, NCCL): a symptom of another rank's fault.
PEER_LOST = re.compile(
    r"Connection (closed|reset) by peer|remote worker (crashing|hanging)|"
    r"NCCL communicator was aborted|ProcessGroupNCCL.*(abort|watchdog)|"
    r"Socket Timeout|Broken pipe",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Notice:
    """The agent's word to one worker: ``phase`` is ``leave`` or ``join``."""

    round: int
    phase: str
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


# ------------------------------------------------------------------ the worker's side
def opt_in(record: str, pid: int) -> None:
    _write(record + OPT_IN_SUFFIX, str(pid))


def read_notice(record: str) -> Notice | None:
    text = _read(record + NOTICE_SUFFIX)
    if not text:
        return None
    try:
        raw = json.loads(text)
        return Notice(int(raw["round"]), str(raw["phase"]), dict(raw.get("env") or {}))
    except (ValueError, KeyError, TypeError):
        return None  # only the agent writes it, whole (a rename): never seen torn


def acknowledge_left(record: str, round_: int) -> None:
    _write(record + LEFT_SUFFIX, str(round_))


def report_broken(record: str, round_: int, error: str) -> None:
    _write(record + BROKEN_SUFFIX, json.dumps({"round": round_, "error": error[:500]}))


# ------------------------------------------- the worker's process: its aborted collectives
_aborts = 0  # how many times this process's round collectives were made to fail
_aborted = False  # made to fail, and the next round's process group not begun yet


def collectives_aborted() -> None:
    """The round's collectives are being made to fail (the wrapper aborts NCCL's
    communicators, shuts gloo's connections).  A GPU kernel that waited on a lost peer then
    ends with a partial all-reduce, and what training computes from it, the step in flight,
    must not be kept as a checkpoint.  Called before the abort, never after it."""
    global _aborts, _aborted
    _aborts += 1
    _aborted = True


def collectives_rejoined() -> None:
    """The next round's process group is about to be built: saves are kept again."""
    global _aborted
    _aborted = False


def collectives_epoch() -> int | None:
    """None while the round's collectives are aborted; else a number that changes with each
    abort.  A save reads it when it starts and again when its state is whole in memory, and
    keeps the step only if both are the same number."""
    return None if _aborted else _aborts


# ------------------------------------------------------------------- the agent's side
def opted_in(record: str) -> int | None:
    """The pid of the worker that can change rounds in-process, or None."""
    text = _read(record + OPT_IN_SUFFIX)
    return int(text) if text and text.strip().isdigit() else None


def tell(record: str, notice: Notice) -> None:
    _write(
        record + NOTICE_SUFFIX,
        json.dumps({"round": notice.round, "phase": notice.phase, "env": notice.env}),
    )


def left(record: str) -> int:
    """The newest round the worker has left (-1: none)."""
    text = _read(record + LEFT_SUFFIX)
    try:
        return int(text) if text else -1
    except ValueError:
        return -1


def broken(record: str) -> tuple[int, str] | None:
    """The round whose collective lost a peer, and the error; None: none did."""
    text = _read(record + BROKEN_SUFFIX)
    try:
        raw = json.loads(text) if text else None
        return (int(raw["round"]), str(raw["error"])) if raw else None
    except (ValueError, KeyError, TypeError):
        return None


def clear(record: str) -> None:
    """Remove the files of a worker that is gone (a new process starts afresh)."""
    for suffix in SUFFIXES:
        with contextlib.suppress(OSError):
            os.unlink(record + suffix)
