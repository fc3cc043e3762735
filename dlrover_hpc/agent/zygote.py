"""Pre-warmed worker interpreters: restarts skip Python start-up and ``import torch``.

A restarted worker spends most of its recovery time importing torch (about 1.1 s here).  The
agent therefore keeps a *zygote*: a Python process that has imported torch once and then only
forks.  Each worker the agent starts (through its process context, `procs.py`) is a
small *client* process that connects to the zygote over a Unix socket and passes its own
stdin, stdout and stderr, its environment, working directory and argv.  The zygote forks a
child that takes those over and runs the training script as ``__main__``.  The client mirrors
the child: it forwards the signals it receives, and exits with the child's exit code, or dies
of the child's signal, so the agent sees exactly what it would see without the zygote.  If the
client dies, the zygote kills the child.  If the zygote is not available, the client simply
executes ``python <script>`` itself.

The zygote is single-threaded (fork is safe) and never runs torch code itself.

Nothing outlives the agent, even a SIGKILLed one (``die_with_parent``): the zygote gets SIGTERM
when the agent dies (and also notices it on its own), then SIGKILLs its children; the clients,
and the workers the agent starts without the zygote (``exec_args``), get SIGKILL; the zygote's
children get SIGKILL when the zygote dies.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import setproctitle

from dlrover_hpc import environ, injections

log = logging.getLogger(__name__)

_MAX_MSG = 1 << 20
_FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR2,
)
#: Slurm's USR1 (``--signal=USR1@T``, a job step's signal) reaches every process of the step,
#: the worker itself among them: a client that passed it on would deliver it twice, and the
#: zygote and a client must not die of it (Python's default). See :func:`hold_requeue_signal`.
_REQUEUE_SIGNAL = signal.SIGUSR1
#: Imported by the zygote besides torch: pure-Python dependencies of torch's compiler stack
#: (sympy: 0.25 s of the 0.85 s that DistributedDataParallel's first use of torch._dynamo costs
#: a worker here).  Never torch._dynamo itself (see :data:`UNSAFE_PRELOADS`).
WARM_MODULES = ("sympy",)
#: ... and, with the torch they were measured on, parts of torch that ``import torch._dynamo``
#: pulls in (roots of its import graph outside ``torch._dynamo.*``): about 0.4 s of that
#: import's 0.8-1.1 s here, saved at every worker start.  Not every such root is safe: with
#: torch.distributed.fsdp, _shard, _local_tensor, _symmetric_memory and _composable
#: preloaded the DDP tutorial hung at exit in 3 runs of 6 (the agent ended the hung ranks);
#: with these, 0 in 28 (and 0 in 6 for each of three parts of them alone).  None imports
#: torch._dynamo or starts a thread (tests/agent/test_zygote.py).  A name a torch build
#: lacks is skipped.
DYNAMO_DEPS: dict[str, tuple[str, ...]] = {
    "2.13": (
        "torch.distributed.tensor",
        "torch.distributed._functional_collectives",
        "torch._functorch._aot_autograd.collect_metadata_analysis",
        "torch.onnx",
        "torch._numpy",
        "torch._higher_order_ops.triton_kernel_wrap",
        "torch._decomp.decompositions_for_rng",
        "torch.nn.utils._expanded_weights",
    ),
}
#: Modules the pre-warmed interpreter must not import on its own: torch._dynamo imported before
#: a script builds its DDP model (before the fork, or at the script's top) makes DDP-on-gloo
#: ranks deadlock at exit in 3 runs of 5 (torch 2.13, under torchrun as well): each backward
#: stashes a Python object in the thread-local state that gloo's all-reduce work captures; the
#: work's last reference can then be dropped by gloo's thread while the main thread, holding
#: the GIL, joins that thread in ``~ProcessGroupGloo``.  A preload that pulls it in
#: (``lightning`` in :data:`environ.PRELOAD`) is said at start: preload only what the script imports
#: first anyway.  The torch.distributed part of that import (115 modules: fsdp and what it
#: pulls in) is enough to bring it on: the tutorial under plain torchrun, 30 s limit,
#: hung in 2 of 2 runs with those modules imported first and 1 of 1 with torch.distributed.fsdp
#: alone; in 1 of 2 with fsdp's dependencies together (nn, _shard, _composable,
#: tensor.parallel, checkpoint_wrapper ...) and in none of 1 with any one of them; in none of 2
#: with torch._dynamo imported right after init_process_group returns (the import is then the
#: one DDP would do, moved earlier).  So no subset of it is known to be safe to preload.  What
#: it costs each fresh worker here: DDP's construction 0.40-0.60 s with the list above
#: preloaded; its bytecode unmarshalled beforehand (no module run) would save only 0.06-0.1 s.
UNSAFE_PRELOADS = ("torch._dynamo",)
#: more modules the pre-warmed interpreter imports, comma-separated (a framework: every
#: worker forked from it skips that import, 3-4 s of CPU for transformers or Lightning); only
#: modules that start no thread at import (a fork keeps only the forking thread)
PRELOAD_ENV = environ.PRELOAD
REQUEUE_BY_ENV = environ.REQUEUE_BY
_PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------- no orphans
def die_with_parent(parent_pid: int, sig: signal.Signals) -> None:
    """Have the kernel send ``sig`` to this process when ``parent_pid`` (its parent) dies.

    Linux sends it when the *thread* that forked this process ends, so the parent must start
    it from a thread that lives as long as the parent does: the agent starts the zygote and
    the workers from its main thread (the event loop's), the zygote has only one thread.  A
    parent that died before this call sends nothing, so the parent's pid is checked after.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent_pid:  # already re-parented: the parent is gone
        os.kill(os.getpid(), sig)


def hold_requeue_signal(env: Mapping[str, str]) -> None:
    """Block Slurm's USR1 in a worker unless ``--requeue-by=framework``.

    With the default (``dlrover-hpc``) the master saves and continues the job; a framework's
    own handler (Lightning's auto-requeue) must not requeue it as well. Blocked from the start
    (kept across exec), the signal stays pending whatever handler the script installs.
    """
    if env.get(REQUEUE_BY_ENV, "dlrover-hpc") != "framework" and injections.enabled(
        injections.USR1_HOLD, env
    ):
        signal.pthread_sigmask(signal.SIG_BLOCK, {_REQUEUE_SIGNAL})


def exec_args(command: Sequence[str]) -> tuple[str, ...]:
    """Arguments for ``python`` that run ``command`` (PATH searched) in the same process, set
    to die with the calling process: the path for workers that the zygote does not fork."""
    return ("-m", "dlrover_hpc.agent.zygote", "exec", str(os.getpid()), *command)


def run_args(argv: Sequence[str], *, module: bool) -> tuple[str, ...]:
    """``python`` arguments: a Python worker run as the zygote's would be (with the hooks)."""
    kind = "--module" if module else "--script"
    return ("-u", "-m", "dlrover_hpc.agent.zygote", "run", str(os.getpid()), kind, *argv)


def set_title(title: str) -> None:
    """The process's command line in ``ps``; its name (``comm``: ``top``, ``pgrep``) stays the
    interpreter's, as started (setproctitle would make it the title's first 15 characters)."""
    setproctitle.setproctitle(title)
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
        comm.write(os.path.basename(sys.executable)[:15])


def python_argv(argv: Sequence[str], *, module: bool) -> list[str]:
    """The command line torchrun starts a Python worker with."""
    return [sys.executable, "-u", *(["-m"] if module else []), *argv]


def worker_title(argv: Sequence[str], *, module: bool) -> str:
    """A worker's process title: the command line torchrun would have started it with."""
    return " ".join(python_argv(argv, module=module))


def _run(parent_pid: int, argv: list[str], *, module: bool) -> None:
    die_with_parent(parent_pid, signal.SIGKILL)
    set_title(worker_title(argv, module=module))
    hold_requeue_signal(os.environ)
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401 - the script's first import anyway; the hooks need it

    from dlrover_hpc.worker import hooks as worker_hooks

    worker_hooks.install()
    sys.exit(_run_main(argv, module=module))


def _exec(parent_pid: int, command: list[str]) -> None:
    die_with_parent(parent_pid, signal.SIGKILL)  # kept across execve
    hold_requeue_signal(os.environ)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"dlrover-run: cannot run {command[0]}: {exc.strerror}", file=sys.stderr)
        sys.exit(126 if isinstance(exc, PermissionError) else 127)


# ---------------------------------------------------------------- the zygote (server)
def warm_modules() -> tuple[str, ...]:
    """What the zygote imports besides torch and the user's preloads (torch imported)."""
    torch = sys.modules.get("torch")
    version = str(getattr(torch, "__version__", "")).split("+")[0]
    return (*WARM_MODULES, *DYNAMO_DEPS.get(".".join(version.split(".")[:2]), ()))


def serve(
    socket_path: str,
    *,
    parent_pid: int,
    preload: tuple[str, ...] = ("torch", "torch.distributed"),
) -> None:
    # SIGTERM, as from Zygote.stop: the loop below ends and kills the children.
    die_with_parent(parent_pid, signal.SIGTERM)
    signal.signal(_REQUEUE_SIGNAL, signal.SIG_IGN)
    for name in preload:
        __import__(name)
    for name in warm_modules():  # quietly: a worker imports what this torch build lacks
        with contextlib.suppress(Exception):
            __import__(name)
    for module in (m for m in UNSAFE_PRELOADS if m in sys.modules):  # torch changed its imports
        print(
            f"dlrover-run: zygote: the warm-up imported {module}: under DDP on gloo a rank may "
            "hang at exit (--no-prewarm avoids it)",
            file=sys.stderr,
        )
    extra = tuple(n.strip() for n in os.environ.get(PRELOAD_ENV, "").split(",") if n.strip())
    for name in extra:  # once here, not once per worker; a worker can do without
        if name in UNSAFE_PRELOADS:
            print(f"dlrover-run: zygote: {name} is not preloaded ({PRELOAD_ENV})", file=sys.stderr)
            continue
        unsafe = [m for m in UNSAFE_PRELOADS if m not in sys.modules]
        try:
            __import__(name)
        except Exception as exc:  # any failure: the worker imports it itself
            print(f"dlrover-run: zygote: cannot preload {name}: {exc}", file=sys.stderr)
        for module in (m for m in unsafe if m in sys.modules):
            print(
                f"dlrover-run: zygote: preloading {name} ({PRELOAD_ENV}) imports {module} "
                "before the script runs: under DDP on gloo a rank may then hang at exit "
                "unless the script imports it first anyway (torch's own race)",
                file=sys.stderr,
            )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(socket_path)
    finally:
        os.umask(old)
    listener.listen(256)
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    try:
        print("ready", flush=True)  # the agent waits for this line
    except BrokenPipeError:  # the agent exited while this server started: nobody to serve
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no second error when stdout is flushed
        return
    stop = False

    def _stop(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stop:
            if os.getppid() != parent_pid:  # the agent died (PR_SET_PDEATHSIG's fallback)
                log.warning("zygote: the agent (pid %d) is gone; stopping", parent_pid)
                break
            conns = list(children.values())
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select([listener, *conns], [], [], 0.05)
            for sock in ready:
                if sock is listener:
                    _accept(listener, children)
                else:  # a client closed its end: it died, so its child must too
                    pid = next(p for p, c in children.items() if c is sock)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            _reap(children)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while children and time.monotonic() < deadline:
            _reap(children)
            time.sleep(0.01)
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)


def _accept(listener: socket.socket, children: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        fds_array = array.array("i")
        msg, ancdata, _flags, _addr = conn.recvmsg(_MAX_MSG, socket.CMSG_SPACE(3 * 4))
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds_array.frombytes(data[: len(data) - (len(data) % 4)])
        request = json.loads(msg)
        fds = list(fds_array)
        if len(fds) != 3:
            raise ValueError(f"expected 3 file descriptors, got {len(fds)}")
    except (OSError, ValueError) as exc:
        log.warning("zygote request refused: %s", exc)
        conn.close()
        return
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid == 0:  # the worker
        conn.close()
        listener.close()
        for other in children.values():
            other.close()
        _become_worker(request, fds, zygote_pid=zygote_pid)  # never returns
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    children[pid] = conn


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        conn.close()


def _become_worker(request: dict, fds: list[int], *, zygote_pid: int) -> None:
    code = 1
    try:
        die_with_parent(zygote_pid, signal.SIGKILL)
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        # In `ps` and `top`, the user's script, as torchrun's worker shows it; not the
        # zygote's title. (Before the environment changes, like the zygote's own title.)
        set_title(worker_title(request["argv"], module=request["module"]))
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_logging()
        _own_thread_pool(os.environ)
        _fresh_random()
        signal.signal(_REQUEUE_SIGNAL, signal.SIG_DFL)  # the zygote ignores it
        hold_requeue_signal(os.environ)
        os.chdir(request["cwd"])
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        from dlrover_hpc.worker import hooks as worker_hooks

        worker_hooks.install()  # progress signals and stack dumps (hang detection)
        code = _run_main(request["argv"], module=request["module"])
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _own_thread_pool(env: Mapping[str, str]) -> None:
    """torch's intra-op thread pool, made again here while this process has one thread.

    A fork leaves the parent's pool behind, marked to be replaced at its next use; when two
    threads of the child make their first parallel call at once (gloo's worker threads, a
    script's own), the loser finds no pool: ``RuntimeError: pool INTERNAL ASSERT FAILED ...
    Invalid thread pool!`` (torch 2.13, 7 runs of 8 with eight threads here; never under
    torchrun, which does not fork).  Its size is the worker's ``OMP_NUM_THREADS``, as a new
    interpreter would read it at ``import torch``, not the zygote's."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    text = env.get("OMP_NUM_THREADS", "")
    threads = int(text) if text.isdigit() and int(text) > 0 else torch.get_num_threads()
    with warnings.catch_warnings():  # "Leaking Caffe2 thread-pool after fork": not the script's
        warnings.simplefilter("ignore")
        torch.set_num_threads(threads)


def _fresh_random() -> None:
    """numpy's global generator seeded afresh, as a new interpreter's is (Python's ``random``
    reseeds itself at a fork): imported by a preload, every worker (and every restart) would
    otherwise draw the same "random" numbers."""
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()


def _fresh_logging() -> None:
    """Logging as a new interpreter has it: the agent's handler (its ``[agent@node]`` lines) and
    level stay with the agent, else a script's ``logging.basicConfig`` does nothing and every
    record a framework logs comes out twice."""
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for log_filter in root.filters[:]:
        root.removeFilter(log_filter)
    root.setLevel(logging.WARNING)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _run_main(argv: list[str], *, module: bool) -> int:
    import runpy

    sys.argv = list(argv)
    if module:
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


# ------------------------------------------------------------------- the client (worker)
def client(socket_path: str, argv: list[str], *, module: bool, parent_pid: int) -> None:
    """Run ``argv`` in a child of the zygote and mirror it; fall back to exec.

    Dies with ``parent_pid`` (the agent); the zygote then kills the child."""
    die_with_parent(parent_pid, signal.SIGKILL)
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        request = json.dumps(
            {"argv": argv, "module": module, "env": dict(os.environ), "cwd": os.getcwd()}
        ).encode()
        sock.sendmsg(
            [request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))]
        )
        reader = sock.makefile("rb")
        first = reader.readline()
        pid = int(json.loads(first)["pid"])
    except (OSError, ValueError, KeyError):
        _exec_directly(argv, module=module)
        return

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.signal(_REQUEUE_SIGNAL, signal.SIG_IGN)  # the worker gets its own
    line = reader.readline()
    code = int(json.loads(line)["exit"]) if line else -signal.SIGKILL
    if code < 0:  # die of the same signal, so the agent sees what happened to the worker
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        code = 128 - code
    sys.exit(code)


def _exec_directly(argv: list[str], *, module: bool) -> None:
    hold_requeue_signal(os.environ)
    os.execv(sys.executable, python_argv(argv, module=module))


# -------------------------------------------------------------------- agent side
class Zygote:
    """The agent's handle: start it early (it imports torch in the background)."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self._proc: subprocess.Popen[str] | None = None
        self._forked = 0  # the pid of a zygote forked from this process (0: none)
        self._out: IO[str] | None = None  # where it says "ready"
        self._ready = False

    @property
    def started(self) -> bool:
        return self._proc is not None or self._forked > 0

    def start(self, env: dict[str, str], *, fork: bool = False) -> None:
        """Start it: a new interpreter that imports torch; or, with ``fork`` in a process that
        imported torch already and runs one thread (the agent, before anything else), a fork
        of this process: no second ``import torch`` (about 2 s of CPU) on the node."""
        if fork and "torch" in sys.modules and threading.active_count() == 1:
            self._fork(env)
            return
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dlrover_hpc.agent.zygote",
                "serve",
                self.socket_path,
                str(os.getpid()),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        self._out = self._proc.stdout

    def _fork(self, env: dict[str, str]) -> None:
        parent = os.getpid()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote: it serves, then leaves without running the parent's code
            code = 1
            try:
                os.close(read)
                signal.set_wakeup_fd(-1)  # the parent's event loop is not ours to wake
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(write, 1)
                os.close(null)
                os.close(write)
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
                # `ps`, pgrep and the chaos tools must not take it (or the workers it forks)
                # for the agent: the command line a zygote started on its own would show.
                # (Before the environment changes: the title may take the environment's room.)
                set_title(
                    f"{sys.executable} -m dlrover_hpc.agent.zygote serve {self.socket_path} "
                    f"{parent}"
                )
                os.environ.clear()
                os.environ.update(env)
                if env.get("OMP_NUM_THREADS", "").isdigit():  # torch read it at its import
                    import torch

                    torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
                serve(self.socket_path, parent_pid=parent, preload=())
                code = 0
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(code)
        os.close(write)
        self._forked = pid
        self._out = os.fdopen(read, "r")

    def _running(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        if self._forked:
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(self._forked, os.WNOHANG)
                return done == 0
        return False

    @property
    def alive(self) -> bool:
        return self._out is not None and self._running()

    def ready(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until it listens; False if it failed."""
        if self._out is None or not self._running():
            return False
        if Path(self.socket_path).exists() and self._ready:
            return True
        ready, _, _ = select.select([self._out], [], [], timeout_s)
        if ready and self._out.readline().strip() == "ready":
            self._ready = True
            return True
        return False

    def client_args(self, argv: list[str], *, module: bool) -> tuple[str, ...]:
        return (
            "-u",
            "-m",
            "dlrover_hpc.agent.zygote",
            "client",
            self.socket_path,
            str(os.getpid()),
            "--module" if module else "--script",
            *argv,
        )

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._forked and self._running():
            os.kill(self._forked, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self._running() and time.monotonic() < deadline:
                time.sleep(0.02)
            if self._running():
                os.kill(self._forked, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self._forked, 0)
        if self._out is not None:
            self._out.close()
        self._proc, self._forked, self._out, self._ready = None, 0, None, False


def main(argv: list[str]) -> None:
    if argv[:1] == ["serve"] and len(argv) == 3:
        serve(argv[1], parent_pid=int(argv[2]))
    elif argv[:1] == ["client"] and len(argv) >= 5:
        client(argv[1], argv[4:], module=argv[3] == "--module", parent_pid=int(argv[2]))
    elif argv[:1] == ["exec"] and len(argv) >= 3:
        _exec(int(argv[1]), argv[2:])
    elif argv[:1] == ["run"] and len(argv) >= 4:
        _run(int(argv[1]), argv[3:], module=argv[2] == "--module")
    else:
        sys.exit(
            "usage: python -m dlrover_hpc.agent.zygote serve SOCKET PARENT_PID | "
            "client SOCKET PARENT_PID --script|--module ARGV... | exec PARENT_PID COMMAND..."
        )


if __name__ == "__main__":
    main(sys.argv[1:])
