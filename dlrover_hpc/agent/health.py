"""Health before joining: the agent checks its node before it joins a round.

Built-in checks, together within :data:`rules.BUILTIN_BUDGET_S` per node: room in /dev/shm for
the node's checkpoint (once its saver has seen one), a write+fsync+remove in the checkpoint
directory (once one is known) within :data:`rules.FSYNC_BOUND_S`, the clock's offset from the
master's, and with ``nvidia-ml-py`` and GPUs the device count, ECC and page-retirement state and
critical XIDs.  Then the site's ``--health-check`` program, NHC's convention: exit 0 healthy,
else the first line of its output is the reason.  The verdicts are the pure functions of
:mod:`dlrover_hpc.agent.health_rules`; this module only measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import logging
import mmap
import os
import shlex
import shutil
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from dlrover_hpc.agent import health_rules as rules
from dlrover_hpc.agent.health_rules import Check, CheckResult, Gpu, GpuFacts
from dlrover_hpc.agent.master_link import MasterLink
from dlrover_hpc.checkpoint.env import DEFAULT_SHM_DIR
from dlrover_hpc.checkpoint.saver.host import SaverHost
from dlrover_hpc.checkpoint.saver.segments import list_segments, read_header
from dlrover_hpc.errors import ConfigError, ProtocolError
from dlrover_hpc.protocol import messages as m

log = logging.getLogger(__name__)
T = TypeVar("T")
#: how long the GPU check listens for critical XID events (NVML reports only new ones)
XID_WAIT_MS = 100
#: the clock check's request to the master waits at most this long
CLOCK_WAIT_S = 2.0
_PROBE_BYTES = b"\0" * 4096

#: the master's wall clock, read once (None: it cannot say, with why)
MasterClock = Callable[[], Awaitable[tuple[float | None, str]]]


# ------------------------------------------------------------------ the site's program
def program_argv(text: str) -> tuple[str, ...]:
    """``--health-check``'s value as a command line (a program, then its arguments)."""
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise ConfigError(
            f"--health-check={text}: {exc}; quote the program and its arguments as one string"
        ) from None


def check_program(text: str) -> None:
    """A ``--health-check`` program that cannot run is a usage error at start (exit 2), not
    a node fault: every node would be excluded for it."""
    if not text:
        return
    argv = program_argv(text)
    name = argv[0] if argv else text
    path = shutil.which(name) if os.sep not in name else name
    if path is None or not os.path.isfile(path):
        raise ConfigError(
            f"--health-check={text}: no such program {name!r}; give an executable's path "
            "(e.g. --health-check=/usr/sbin/nhc) or a program on PATH"
        )
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"--health-check={text}: {path} is not executable; chmod +x it or run it through "
            f"its interpreter (e.g. --health-check='/bin/sh {path}')"
        )


async def run_program(argv: Sequence[str], timeout_s: float) -> CheckResult:
    """Run the site's program in its own session; killed (with its children) at the timeout."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:  # removed since the start, or its interpreter is missing
        return rules.program(argv=argv, returncode=-1, error=exc.strerror or str(exc))
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return rules.program(argv=argv, returncode=None, timeout_s=timeout_s)
    except asyncio.CancelledError:  # the agent stops: the program and its children too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()  # reaped, its pipes closed, before the loop ends
        raise
    return rules.program(
        argv=argv,
        returncode=proc.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
    )


# ------------------------------------------------------------------ built-in readings
async def in_thread(fn: Callable[[], T], timeout_s: float) -> tuple[T | None, bool]:
    """``fn()`` in a daemon thread: (its result, True), or (None, False) when it did not return
    within ``timeout_s`` (a hung file system: the thread is left behind, the agent goes on)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result, exc = fn(), None
        except BaseException as e:  # handed to the caller's await
            result, exc = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="health-check", daemon=True).start()
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            return await fut, True
    except TimeoutError:
        return None, False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ShmUsage:
    """The node's checkpoint segments in /dev/shm, as its saver's prefix finds them."""

    checkpoint_bytes: int = 0  # every rank's two buffers of its largest segment's size
    resident_bytes: int = 0  # what they hold already
    ckpt_dirs: tuple[str, ...] = ()  # the checkpoint directories their steps name


def _ckpt_dir_of(path: str) -> str:
    """The checkpoint directory a segment's newest complete step names ("" if none)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = read_header(buf)
    except (OSError, ValueError):  # removed meanwhile, or empty
        return ""
    return str(header.meta.get("ckpt_dir") or "") if header is not None else ""


def shm_usage(shm_dir: str, prefix: str) -> ShmUsage:
    per_rank: dict[tuple[int, str], int] = {}
    resident = 0
    dirs: dict[str, None] = {}
    for seg in list_segments(shm_dir, prefix) if prefix else ():
        try:
            s = os.stat(seg.path)
        except OSError:
            continue  # removed meanwhile
        key = (seg.rank, seg.tag)
        per_rank[key] = max(per_rank.get(key, 0), s.st_size)
        resident += min(s.st_size, s.st_blocks * 512)
        if found := _ckpt_dir_of(seg.path):
            dirs[found] = None
    return ShmUsage(
        checkpoint_bytes=2 * sum(per_rank.values()),
        resident_bytes=resident,
        ckpt_dirs=tuple(dirs),
    )


def probe_directory(directory: str) -> str:
    """Where the first persist will write: ``directory``, or, while it is not made yet (the
    saver makes it then; a job that has only saved to memory has none), its nearest ancestor
    that exists.  OSError when that ancestor is not a directory (the saver could not make it)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    return path


def fsync_probe(directory: str, node: str) -> float:
    """Seconds to write, fsync and remove a small file where ``directory``'s first persist
    will write (:func:`probe_directory`); OSError if refused."""
    path = os.path.join(probe_directory(directory), f".dlrover-hpc-health-{node}-{os.getpid()}")
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, _PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return time.perf_counter() - began


async def storage_reading(directory: str, node: str, budget_s: float) -> CheckResult:
    if not directory:
        return rules.storage(directory="", fsync_s=None)
    if "://" in directory:
        return rules.skipped(Check.STORAGE, f"{directory} is not a local path")
    bound = min(rules.FSYNC_BOUND_S, budget_s)
    try:
        took, done = await in_thread(lambda: fsync_probe(directory, node), bound)
    except OSError as exc:
        return rules.storage(directory=directory, fsync_s=None, error=exc.strerror or str(exc))
    return rules.storage(directory=directory, fsync_s=took if done else None, bound_s=bound)


async def clock_reading(master_clock: MasterClock, budget_s: float) -> CheckResult:
    sent = time.time()
    try:
        async with asyncio.timeout(max(0.1, min(CLOCK_WAIT_S, budget_s))):
            master_time, why = await master_clock()
    except TimeoutError:
        master_time, why = None, "the master did not say its time in time"
    return rules.clock(master_time=master_time, sent=sent, received=time.time(), why_unknown=why)


# ------------------------------------------------------------------ GPUs (NVML)
def load_nvml() -> tuple[Any, str]:
    """``pynvml`` (from ``nvidia-ml-py``), imported only when a check runs; (None, why)."""
    try:
        import pynvml  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None, "nvidia-ml-py (pynvml) is not installed"
    return pynvml, ""


def expected_gpus(env: Mapping[str, str]) -> int:
    """The GPUs this node should have: Slurm's ``SLURM_GPUS_ON_NODE`` (a job that asked for
    GPUs), else as many as ``CUDA_VISIBLE_DEVICES`` names; 0: no count to compare with."""
    with contextlib.suppress(ValueError):
        return max(0, int(env.get("SLURM_GPUS_ON_NODE", "")))
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([d for d in visible.split(",") if d.strip()]) if visible else 0


def read_gpus(nvml: Any, *, xid_wait_ms: int = XID_WAIT_MS) -> GpuFacts:
    """Every device's state through ``nvml`` (pynvml's API); raises its NVMLError when
    there is no driver.  A query a device does not support counts as nothing wrong."""
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        xids = _xids(nvml, handles, xid_wait_ms)
        return GpuFacts(
            gpus=tuple(_gpu(nvml, i, h, xids.get(i, ())) for i, h in enumerate(handles))
        )
    finally:
        nvml.nvmlShutdown()


def _query(nvml: Any, fn: Callable[[], T], default: T) -> T:
    try:
        return fn()
    except nvml.NVMLError:  # not supported on this device (no ECC, no row remapping)
        return default


def _gpu(nvml: Any, index: int, h: Any, xids: tuple[int, ...]) -> Gpu:
    ecc = _query(
        nvml,
        lambda: int(
            nvml.nvmlDeviceGetTotalEccErrors(
                h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            )
        ),
        0,
    )
    retired = _query(nvml, lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h), 0)
    remap = _query(nvml, lambda: tuple(nvml.nvmlDeviceGetRemappedRows(h)), (0, 0, 0, 0))
    return Gpu(
        index=index,
        uncorrected_ecc=ecc,
        retired_pending=retired == nvml.NVML_FEATURE_ENABLED,
        remap_pending=bool(remap[2]),
        remap_failed=bool(remap[3]),
        xids=xids,
    )


def _xids(nvml: Any, handles: Sequence[Any], wait_ms: int) -> dict[int, tuple[int, ...]]:
    """Critical XID events NVML delivers within ``wait_ms``, by device index."""
    found: dict[int, list[int]] = {}
    try:
        events = nvml.nvmlEventSetCreate()
    except nvml.NVMLError:
        return {}
    try:
        for h in handles:
            with contextlib.suppress(nvml.NVMLError):  # a device without events
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, events)
        deadline = time.monotonic() + wait_ms / 1000
        while (left := deadline - time.monotonic()) > 0:
            try:
                data = nvml.nvmlEventSetWait(events, max(1, int(left * 1000)))
            except nvml.NVMLError:  # a timeout: nothing more
                break
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError:
                index = -1
            found.setdefault(index, []).append(int(data.eventData))
    finally:
        _query(nvml, lambda: nvml.nvmlEventSetFree(events), None)
    return {i: tuple(x) for i, x in found.items()}


async def gpu_reading(
    expected: int, budget_s: float, nvml_loader: Callable[[], tuple[Any, str]]
) -> CheckResult:
    nvml, why = nvml_loader()
    if nvml is None:
        return rules.gpu(None, expected=expected, why_unknown=why)
    try:
        facts, done = await in_thread(lambda: read_gpus(nvml), budget_s)
    except nvml.NVMLError as exc:  # no driver, no devices: nothing to check
        return rules.gpu(None, expected=expected, why_unknown=f"NVML: {exc}")
    if not done:
        return rules.failed(Check.GPU, f"NVML did not answer within {budget_s:.1f} s")
    return rules.gpu(facts, expected=expected)


# ------------------------------------------------------------------ all of them
async def timed(make: Callable[[], Awaitable[CheckResult]]) -> CheckResult:
    """The check ``make()`` runs, with what it cost."""
    began = time.perf_counter()
    result = await make()
    ms = round((time.perf_counter() - began) * 1000, 3)
    return CheckResult(check=result.check, status=result.status, reason=result.reason, ms=ms)


class NodeHealth:
    """The node's checks, as its agent runs them before it joins a round."""

    def __init__(
        self,
        *,
        node: str,
        program: str = "",
        program_timeout_s: float = 60.0,
        expected_gpus: int = 0,
        shm_dir: str = DEFAULT_SHM_DIR,
        nvml_loader: Callable[[], tuple[Any, str]] = load_nvml,
    ) -> None:
        self.node = node
        self.argv = program_argv(program) if program else ()
        self.program_timeout_s = program_timeout_s
        self.expected_gpus = expected_gpus
        self.shm_dir = shm_dir
        self._nvml_loader = nvml_loader
        #: the largest checkpoint size seen on this node (its segments may be gone since)
        self.checkpoint_bytes = 0
        #: the checkpoint directories seen on this node (its segments name them)
        self.ckpt_dirs: dict[str, None] = {}

    async def shm(self, prefix: str) -> CheckResult:
        try:
            st = os.statvfs(self.shm_dir)
        except OSError as exc:
            return rules.shm(path=self.shm_dir, free_bytes=None, checkpoint_bytes=0, error=str(exc))
        usage = shm_usage(self.shm_dir, prefix)
        self.checkpoint_bytes = max(self.checkpoint_bytes, usage.checkpoint_bytes)
        self.ckpt_dirs.update(dict.fromkeys(usage.ckpt_dirs))
        return rules.shm(
            path=self.shm_dir,
            free_bytes=st.f_bavail * st.f_frsize,
            checkpoint_bytes=self.checkpoint_bytes,
            resident_bytes=usage.resident_bytes,
        )

    async def check(
        self,
        *,
        segment_prefix: str = "",
        ckpt_dirs: Sequence[str] = (),
        master_clock: MasterClock | None = None,
    ) -> list[CheckResult]:
        """Every check's result, in order; the built-in ones within the budget together.
        ``segment_prefix``: the node's saver's (its segments in /dev/shm: their size, and the
        checkpoint directory their steps name); ``ckpt_dirs``: the directories its saver
        persisted to."""
        deadline = time.monotonic() + rules.BUILTIN_BUDGET_S

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        results = [await timed(lambda: self.shm(segment_prefix))]
        for directory in {**dict.fromkeys(ckpt_dirs), **self.ckpt_dirs} or ("",):
            probe = functools.partial(storage_reading, directory, self.node, left())
            results.append(await timed(probe))
        if master_clock is None:
            results.append(rules.skipped(Check.CLOCK, "no master to compare with"))
        else:
            clock = master_clock
            results.append(await timed(lambda: clock_reading(clock, left())))
        expected, loader = self.expected_gpus, self._nvml_loader
        results.append(await timed(lambda: gpu_reading(expected, max(0.5, left()), loader)))
        if self.argv:
            argv, timeout_s = self.argv, self.program_timeout_s
            results.append(await timed(lambda: run_program(argv, timeout_s)))
        return results


# ------------------------------------------------------------------ before joining
async def master_time(link: MasterLink) -> tuple[float | None, str]:
    """The master's wall clock; (None, why) from a master that cannot say (an older one)."""
    try:
        reply = await link.request(m.ClockRequest(), m.ClockReply, timeout_s=CLOCK_WAIT_S)
    except ProtocolError as exc:
        return None, f"the master cannot say its time ({exc})"
    except (TimeoutError, ConnectionError) as exc:
        return None, str(exc) or type(exc).__name__
    return reply.time, ""


async def gate(
    health: NodeHealth, link: MasterLink, agent_id: str, saver: SaverHost | None
) -> CheckResult | None:
    """Check the node before it joins a round; an unhealthy node is reported to the master
    (which excludes and drains it).  Returns the failed check, or None: join."""
    results = await health.check(
        segment_prefix=saver.prefix if saver is not None else "",
        ckpt_dirs=saver.ckpt_dirs() if saver is not None else [],
        master_clock=lambda: master_time(link),
    )
    lines = [r.line() for r in results]
    bad = rules.verdict(results)
    if bad is None:
        log.info("node healthy %s", " ".join(lines))
        return None
    log.error(
        "node unhealthy check=%s reason=%s: it does not join the job; %s",
        bad.check,
        bad.reason,
        " ".join(lines),
    )
    unhealthy = m.NodeUnhealthy(
        agent_id=agent_id, check=bad.check, reason=bad.reason, results=lines
    )
    try:
        await link.request(unhealthy, m.Ack, timeout_s=30)
    except (ProtocolError, TimeoutError, ConnectionError) as exc:
        log.error("the master did not take the node's health report: %s", exc)
    return bad
