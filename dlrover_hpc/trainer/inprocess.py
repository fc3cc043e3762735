"""Recovery without a new process: the surviving workers change rounds in-process (issue 26).

Under ``dlrover-run`` a membership change (a node lost, a node joining, a worker of another
node dead) ends every worker of the job and starts new processes: a new interpreter,
``import torch``, a CUDA context, the model built again.  A training function wrapped with
:func:`wrap` keeps its process instead::

    from dlrover_hpc.trainer import inprocess

    @inprocess.wrap
    def train(args):
        dist.init_process_group("gloo")  # from the environment, as under torchrun
        ...                               # build, restore (flash checkpoint), train
        dist.destroy_process_group()

    train(args)

When the agent says a new round is coming, the wrapper makes the function leave the round:
it aborts NCCL's communicators and shuts the read side of the TCP connections the function
opened (gloo's peers, the round's store), so a collective that waits on a lost peer fails at
once instead of after its timeout.  It keeps those connections open (a duplicate of each)
until the new round's word: a peer still inside the collective writes into a connection
that is there, not one gloo closed when it failed, which would fail that write.

From that moment no step is kept as a checkpoint until the next round's process group
(:func:`dlrover_hpc.worker.membership.collectives_aborted`): with NCCL the GPU, not the training
thread, waits for an all-reduce, and an aborted one leaves a partial sum that the optimizer
applies and a save would keep.

The function's exception ends the attempt; the wrapper tears the process group down, tells
the agent it has left, waits for the new round, takes its environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``, ...) and
calls the function again in the same process.  The function restores as it does at any
start: the flash checkpointer finds the newest step in the node's shared memory (a replaced
rank gets its part from a peer), so the survivors pay for a restore from memory and a new
process group, not for a new process.

What stays as it was:

- a worker of *this* node that dies, or one that does not leave within a few seconds (a
  stopped or deadlocked rank), is replaced the usual way: the agent ends this node's workers
  and starts new ones, which run the wrapped function from the top;
- an exception that no round change explains (a bug, an out-of-memory) ends the process as
  before: the wrapper waits :data:`environ.INPROCESS_WAIT_S` (60 s) for the agent's word after
  a failed collective, since a lost peer is often seen before the master has decided;
- outside ``dlrover-run`` the wrapper only calls the function.

What the function holds across attempts is up to it: everything it creates is created again
(a model, an optimizer, a checkpointer; close a checkpointer in a ``finally`` where you can),
module-level state stays (imported modules, a CUDA context, a dataset cached in a global).
:func:`restarts` is how many times this process has changed rounds.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from typing import ParamSpec, TypeVar

import torch.distributed as dist

from dlrover_hpc import environ, injections
from dlrover_hpc.worker import membership
from dlrover_hpc.worker.progress import PATH_ENV

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger(__name__)

#: how often a worker looks for the agent's notice (one small file read, off the training
#: thread) and, once it has left, for the next round's word (the training thread waits)
POLL_S = 0.02
JOIN_POLL_S = 0.005
WAIT_ENV = environ.INPROCESS_WAIT_S
#: after an exception with no notice yet, how long to wait for one before failing as before
DEFAULT_WAIT_S = 60.0
ROUND_ENV = environ.ROUND
NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: after the first sweep, how often the watch shuts the attempt's connections again until the
#: function has raised (a connection it missed or opened meanwhile)
SWEEP_S = 0.25

_restarts = 0


def restarts() -> int:
    """How many times this process has left a round and joined the next."""
    return _restarts


def wrap(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` runs again in this process after a membership change (see the module text)."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        record = os.environ.get(PATH_ENV, "")
        if not record:  # not under dlrover-run: no agent to tell us of a round
            return fn(*args, **kwargs)
        return _attempts(record, functools.partial(fn, *args, **kwargs))

    return run


def _attempts(record: str, call: Callable[[], R]) -> R:
    global _restarts
    keep_process_on_nccl_errors(os.environ)
    membership.opt_in(record, os.getpid())
    _collect()  # once, at the start: a round change then walks only its attempt's objects
    while True:
        base = int(os.environ.get(ROUND_ENV, "0"))
        watch = _Watch(record, base, before=_tcp_sockets())
        watch.start()
        try:
            result = call()
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if watch.notice is None and membership.PEER_LOST.search(text):
                membership.report_broken(record, base, text)  # the agent tells the master
            notice = watch.wait(_wait_s())
            if notice is None:
                watch.release()
                raise  # no round change explains it: fail as a worker always did
            _say(f"leaves round {base} ({type(exc).__name__}: {str(exc)[:200]})")
        else:
            watch.release()
            return result
        watch.stop()
        left_at = time.monotonic()
        watch.leave()  # what the function opened since the watch began, if not done yet
        _tear_down()
        torn_down_s = time.monotonic() - left_at
        # Out of every collective: the round may form while the attempt's garbage goes.
        membership.acknowledge_left(record, notice.round)
        _collect()
        joined = _await_join(record, base)
        # Every survivor has left (the round formed after they did): the held connections
        # may close now, before the next attempt opens its own.
        watch.release()
        _bury()
        os.environ.update(joined.env)
        membership.collectives_rejoined()
        _restarts += 1
        _say(
            f"joins round {joined.round} as rank {joined.env.get('RANK')} of "
            f"{joined.env.get('WORLD_SIZE')} after {time.monotonic() - left_at:.2f} s "
            f"(left in {torn_down_s:.2f} s; in-process restart {_restarts})"
        )


def keep_process_on_nccl_errors(environ: MutableMapping[str, str]) -> None:
    """Make NCCL's error handling abort the communicators and raise, keeping the process (2).
    1 (dlrover-run's) and 3 (torch's default) tear the process down on a communicator error:
    a peer's death, or the abort of a round change.  0 (no handling) is the user's choice."""
    if environ.get(NCCL_ERRORS_ENV, "3") in ("1", "3"):
        environ[NCCL_ERRORS_ENV] = "2"


def _wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S)))
    except ValueError:
        return DEFAULT_WAIT_S


def _say(text: str) -> None:
    print(f"dlrover-run: rank {os.environ.get('RANK', '?')} {text}", file=sys.stderr, flush=True)


class _Watch(threading.Thread):
    """Looks for the agent's notice of a round after ``base``; makes the function leave."""

    def __init__(self, record: str, base: int, *, before: dict[int, int]) -> None:
        super().__init__(name="dlrover-hpc-inprocess", daemon=True)
        self._record, self._base, self._before = record, base, before
        self._stopped = threading.Event()
        self._noticed = threading.Event()
        self._left = False
        self._lock = threading.Lock()
        self._held: dict[int, socket.socket] = {}  # socket inode -> our duplicate of it
        self.notice: membership.Notice | None = None

    def run(self) -> None:
        while not self._stopped.wait(POLL_S):
            notice = membership.read_notice(self._record)
            if notice is not None and notice.round > self._base:
                self.notice = notice
                self.leave()
                self._noticed.set()
                break
        # Until the function has raised (stop()), sweep again: a collective can go on waiting
        # on a connection the first sweep did not shut (opened meanwhile, or one more).
        while not self._stopped.wait(SWEEP_S):
            _shut_connections(self._before, self._held)

    def wait(self, timeout_s: float) -> membership.Notice | None:
        self._noticed.wait(timeout_s)
        return self.notice

    def leave(self) -> None:
        with self._lock:
            if not self._left:
                self._left = True
                _leave_collectives(self._before, self._held)

    def stop(self) -> None:
        """No more sweeps: back from here, no socket of the next attempt is touched."""
        self._stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join()

    def release(self) -> None:
        """Stop, and close the duplicates of the attempt's connections."""
        self.stop()  # no sweep adds one meanwhile
        held, self._held = self._held, {}
        for sock in held.values():
            sock.close()


def _leave_collectives(before: dict[int, int], held: dict[int, socket.socket]) -> None:
    """Make every collective of the process group fail now: abort NCCL's communicators, shut
    down the TCP connections opened since ``before`` (gloo's pairs, the store's client).
    First of all, no step saved from here on is kept (an aborted NCCL all-reduce leaves a
    partial sum in the gradients, and the GPU goes on with it)."""
    membership.collectives_aborted()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # a group torn down meanwhile
            if "nccl" in str(dist.get_backend()).lower():
                abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
                if abort is not None:
                    # The abort forgets the groups; the attempt's model (DDP) still holds
                    # them, and the last reference would end them on the main thread as the
                    # attempt's frames are freed: seconds of joining NCCL's watchdog threads.
                    # Held here, they end on a thread of their own (_bury).
                    _aborted_groups.extend(dist.distributed_c10d._world.pg_names)
                    abort()
    _shut_connections(before, held)


#: process groups aborted by a round change, not yet ended (see `_leave_collectives`)
_aborted_groups: list[object] = []


def _bury() -> None:
    """End the aborted process groups off the training thread: their destructors release the
    GIL (torch's c10d bindings) and join NCCL's threads while the next attempt goes on."""
    if not _aborted_groups:
        return
    groups = _aborted_groups[:]
    _aborted_groups.clear()

    def end() -> None:
        began = time.monotonic()
        groups.clear()  # the last references
        log.debug("aborted process groups ended in %.2f s", time.monotonic() - began)

    threading.Thread(target=end, name="dlrover-hpc-inprocess-bury", daemon=True).start()


def _shut_connections(before: dict[int, int], held: dict[int, socket.socket]) -> None:
    """Shut the read side of each TCP connection opened since ``before``, and keep a
    duplicate of it in ``held``.

    Every read gloo (or the store's client) makes after the shutdown sees an end of stream, so
    the pair fails and the collective raises "Connection closed by peer".  No write may fail,
    here or at a peer: gloo parks a send that fails (EPIPE, ECONNRESET) in its transmit queue
    and, when the pair then fails, does not wake the collective waiting on that send, which
    waits for gloo's 30-minute timeout.  So the write side stays open, and so does the whole
    connection when gloo closes its descriptor on the failure: our duplicate keeps it, and a
    peer's write into it is queued rather than answered with a reset.  Shutting both sides
    hung 2 of some 120 changes here; the read side alone, with gloo closing, 1 change in a CI
    run (a peer wrote as this side closed)."""
    for fd, inode in _tcp_sockets().items():
        if before.get(fd) == inode or inode in held:
            continue  # the script's own, from before this attempt; or shut already
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile
        try:
            if os.fstat(sock.fileno()).st_ino != inode:
                sock.close()  # the descriptor was closed and reused meanwhile
                continue
            sock.shutdown(socket.SHUT_RD)  # the socket, not only this descriptor
        except OSError:
            sock.close()
            continue
        held[inode] = sock


def _tcp_sockets() -> dict[int, int]:
    """This process's TCP sockets other than listeners: descriptor -> socket inode.  Not a
    listening socket: gloo's listener ends the process (std::terminate) when its accept
    fails.  Each descriptor is asked itself (no walk of the host's whole TCP table, which can
    be long and is not read atomically)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue  # closed meanwhile
        with sock:
            try:
                tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and (
                    sock.type == socket.SOCK_STREAM
                )
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            except OSError:
                continue
        if tcp and not listening:
            found[int(name)] = int(target[8:-1])
    return found


def _tear_down() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # its connections are gone already
            dist.destroy_process_group()


def _collect() -> None:
    """Free the attempt's model, optimizer and DDP reducer (reference cycles: GPU memory)
    before the next attempt builds them again, then freeze what outlived it.

    A full collection walks every object the interpreter tracks: with torch imported, 0.16 s
    of a stall on this machine kind.  Frozen objects (:func:`gc.freeze`) are left out of it:
    what lived before the first attempt (imported modules, the script's globals) and whatever
    outlived an attempt (modules it imported, caches).  So a round change walks only the
    objects of the attempt that just ended.  A frozen object that later becomes cyclic
    garbage stays until the process ends: long-lived ones only, by the time they freeze."""
    gc.collect()
    if injections.enabled(injections.GC_HANDLING):
        gc.freeze()


def _await_join(record: str, base: int) -> membership.Notice:
    """Wait for the agent's ``join`` of a round after ``base``: as long as rendezvous takes
    (a replacement node may be on its way); the worker dies with its agent."""
    while True:
        notice = membership.read_notice(record)
        if notice is not None and notice.phase == membership.JOIN and notice.round > base:
            return notice
        time.sleep(JOIN_POLL_S)
