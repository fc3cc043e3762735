"""Pre-warmed worker interpreters: the client mirrors its forked child exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from harness.ports import free_port
from runtime_helpers import BIN

from dlrover_hpc.agent.zygote import Zygote
from dlrover_hpc.localslurm import wait_for
from dlrover_hpc.netcheck.launch import run_probe_subprocess
from dlrover_hpc.netcheck.result import ProbeResult

SCRIPT = """
import json, os, sys, time
out = {"preloaded": "torch" in sys.modules, "argv": sys.argv[1:], "name": __name__,
       "cwd": os.getcwd(), "env": os.environ.get("ZYGOTE_TEST"),
       "title": open("/proc/self/cmdline").read().replace("\\0", " ").strip(),
       "comm": open("/proc/self/comm").read().strip()}
open(sys.argv[1], "w").write(json.dumps(out))
mode = sys.argv[2]
if mode == "exit":
    sys.exit(7)
if mode == "raise":
    raise RuntimeError("boom from the worker")
if mode == "sleep":
    time.sleep(60)
"""

pytestmark = pytest.mark.runtime  # whole agents and workers: not in make test-fast


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    z = Zygote(str(tmp_path / "z.sock"))
    z.start(dict(os.environ))
    assert z.ready(60), "the zygote did not come up"
    yield z
    z.stop()


def _client(
    z: Zygote | None, sock: str, script: Path, *args: str, cwd: Path, **kw: object
) -> subprocess.Popen[str]:
    client_args = (z or Zygote(sock)).client_args([str(script), *args], module=False)
    env = {**os.environ, "ZYGOTE_TEST": "yes"}
    return subprocess.Popen(
        [sys.executable, *client_args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )  # type: ignore[call-overload]


def test_child_runs_script_as_main_with_torch_preloaded(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = _client(zygote, zygote.socket_path, script, str(out), "exit", cwd=tmp_path)
    assert proc.wait(60) == 7
    seen = json.loads(out.read_text())
    assert seen == {
        "preloaded": True,
        "argv": [str(out), "exit"],
        "name": "__main__",
        "cwd": str(tmp_path),
        "env": "yes",
        # in ps and top, the script as torchrun's worker shows it, not the zygote
        "title": f"{sys.executable} -u {script} {out} exit",
        "comm": os.path.basename(sys.executable)[:15],  # top and pgrep: the interpreter
    }


def test_exceptions_print_a_traceback_on_the_clients_stderr(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    proc = _client(zygote, zygote.socket_path, script, str(tmp_path / "o"), "raise", cwd=tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "RuntimeError: boom from the worker" in err


def test_signals_are_forwarded_and_mirrored(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = _client(zygote, zygote.socket_path, script, str(out), "sleep", cwd=tmp_path)
    wait_for(out.exists, timeout_s=60, what="the worker to start")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM


def test_a_worker_killed_by_sigkill_looks_killed_by_sigkill(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "k.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = _client(zygote, zygote.socket_path, script, cwd=tmp_path)
    assert proc.wait(30) == -signal.SIGKILL


def test_killed_client_takes_its_child_along(zygote: Zygote, tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = _client(zygote, zygote.socket_path, script, str(out), "sleep", cwd=tmp_path)
    wait_for(out.exists, timeout_s=60, what="the worker to start")
    zygote_pid = zygote._proc.pid  # type: ignore[union-attr]
    children = psutil.Process(zygote_pid).children()
    assert len(children) == 1
    proc.kill()
    proc.wait(10)
    wait_for(
        lambda: not psutil.Process(zygote_pid).children(),
        timeout_s=10,
        what="the orphaned worker to be killed",
    )


def test_without_a_zygote_the_client_runs_the_script_itself(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    proc = _client(None, str(tmp_path / "absent.sock"), script, str(out), "exit", cwd=tmp_path)
    assert proc.wait(60) == 7
    assert json.loads(out.read_text())["preloaded"] is False


def test_restarted_workers_come_from_the_zygote(tmp_path: Path) -> None:
    script = tmp_path / "r.py"
    script.write_text(
        "import json, os, sys, time\n"
        "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    time.sleep(10); sys.exit(5)  # the zygote warms up meanwhile\n"
        "open(f'r{os.environ[\"RANK\"]}.json', 'w').write(json.dumps('torch' in sys.modules))\n"
    )
    proc = subprocess.run(
        [
            str(BIN / "dlrover-run"),
            "--standalone",
            "--nproc-per-node=2",
            f"--job-dir={tmp_path / 'job'}",
            str(script),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads((tmp_path / f"r{r}.json").read_text()) for r in (0, 1)] == [True, True]


def test_network_probes_run_as_forks_of_the_zygote(zygote: Zygote) -> None:
    """The agent's probes come from the zygote (no `import torch` each): a pair passes, and a
    probe whose partner never comes is killed at its deadline with nothing left behind."""
    runner = (sys.executable, *zygote.client_args([], module=True))
    zygote_pid = zygote._proc.pid  # type: ignore[union-attr]
    forks: set[int] = set()
    port = free_port()

    def probe(rank: int, timeout_s: float, port: int) -> ProbeResult:
        return run_probe_subprocess(
            group_rank=rank,
            group_size=2,
            store_host="127.0.0.1",
            store_port=port,
            timeout_s=timeout_s,
            is_store_host=rank == 0,
            use_cuda=False,
            payload_bytes=4096,
            matmul_size=32,
            runner=runner,
        )

    with ThreadPoolExecutor(3) as pool:
        pair = [pool.submit(probe, r, 60.0, port) for r in (0, 1)]
        while not all(f.done() for f in pair):  # the probes are the zygote's children
            forks |= {c.pid for c in psutil.Process(zygote_pid).children()}
            time.sleep(0.02)
        results = [f.result() for f in pair]
    assert all(r.ok and r.check_s is not None for r in results), results
    assert len(forks) == 2, forks
    # a lone probe: its own error if it has time for one, else the kill; either way in time
    lone = probe(1, 3.0, free_port())
    assert not lone.ok, lone
    wait_for(
        lambda: not psutil.Process(zygote_pid).children(),
        timeout_s=10,
        what="the lone probe's fork to be gone",
    )


FORKED = """
import json, os, subprocess, sys
import psutil, torch
from dlrover_hpc.agent.zygote import Zygote

z = Zygote(sys.argv[1])
z.start(dict(os.environ, OMP_NUM_THREADS="1"), fork=True)
assert z.ready(60), "the forked zygote did not come up"
me = psutil.Process()
[child] = me.children()
out = subprocess.run(
    [sys.executable, *z.client_args([sys.argv[2], sys.argv[3], "ok"], module=False)],
    capture_output=True, text=True, timeout=60,
)
report = {
    "parent": os.getpid(), "forked": z._forked, "child": child.pid,
    "cmdline": " ".join(child.cmdline()).strip(), "name": child.name(),
    "returncode": out.returncode, "stderr": out.stderr[-2000:],
}
z.stop()
report["stopped"] = not psutil.pid_exists(report["forked"]) and not me.children()
print(json.dumps(report))
"""


def test_the_agent_forks_its_zygote_when_torch_is_imported_and_it_runs_one_thread(
    tmp_path: Path,
) -> None:
    """No second `import torch` on the node: a fork of the agent (one thread, torch imported)
    serves as the zygote, shows as one in `ps`, forks workers with torch preloaded, stops."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    sock = tmp_path / "z.sock"
    done = subprocess.run(
        [sys.executable, "-c", FORKED, str(sock), str(script), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["forked"] == report["child"] > 0, report
    title = f"{sys.executable} -m dlrover_hpc.agent.zygote serve {sock} {report['parent']}"
    assert report["cmdline"] == title, report
    assert report["name"] == os.path.basename(sys.executable)[:15], report
    assert report["returncode"] == 0, report
    worker = json.loads(out.read_text())
    assert worker["preloaded"] and worker["name"] == "__main__", worker
    assert report["stopped"], report


def test_torch_dynamo_is_never_preloaded_and_a_preload_that_imports_it_is_said(
    tmp_path: Path,
) -> None:
    """Issue 45: torch._dynamo imported before a script builds its DDP model makes gloo's
    teardown deadlock at exit; the zygote refuses to preload it by name and says which
    DLROVER_HPC_PRELOAD module pulled it in (lightning does)."""
    (tmp_path / "pulls_dynamo.py").write_text("import torch._dynamo\n")
    env = {
        **os.environ,
        "DLROVER_HPC_PRELOAD": "torch._dynamo,pulls_dynamo",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrover_hpc.agent.zygote", "serve", str(tmp_path / "z.sock"),
         str(os.getpid())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "torch._dynamo is not preloaded (DLROVER_HPC_PRELOAD)" in err, err
    assert "preloading pulls_dynamo (DLROVER_HPC_PRELOAD) imports torch._dynamo" in err, err
    assert "WARM" not in err and "sympy" not in err, err  # the default warm-up is quiet


WARM_PROBE = """
import json, sys, threading, time
import torch, torch.distributed
from dlrover_hpc.agent.zygote import warm_modules
names = warm_modules()
for name in names:
    __import__(name)
warm = {"names": list(names), "dynamo": "torch._dynamo" in sys.modules,
        "threads": threading.active_count(), "version": torch.__version__}
started = time.process_time()
import torch._dynamo
warm["dynamo_cpu_s"] = time.process_time() - started
print(json.dumps(warm))
"""


def test_the_warm_up_takes_part_of_the_compiler_stack_but_not_torch_dynamo_nor_a_thread() -> None:
    """The zygote's warm-up (sympy and, on the torch it was measured on, parts of what
    ``import torch._dynamo`` pulls in) imports every name it lists, never torch._dynamo (the
    exit deadlock) and starts no thread (a fork keeps only the forking thread).  Whether a
    part brings the deadlock back is for the DDP tutorial's runs (test_unchanged_clients)."""
    out = subprocess.run(
        [sys.executable, "-c", WARM_PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    warm = json.loads(out.stdout.splitlines()[-1])
    assert warm["dynamo"] is False and warm["threads"] == 1, warm
    assert warm["names"][0] == "sympy", warm
    if warm["version"].startswith("2.13."):  # the torch of this checkout: the list is live
        assert "torch.distributed.tensor" in warm["names"], warm
    print(json.dumps({"torch_dynamo_cpu_s_after_warm_up": round(warm["dynamo_cpu_s"], 3)}))
