"""``dlrover-hpc launch`` against real sshd hosts: one network namespace per host (root).

The hosts share this machine's file system (venv, job and checkpoint directories), like a
cluster file system; each has its own network, host name, /etc/hosts and /dev/shm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from harness.isolation import worker_index
from harness.sshd import SshdCluster, SshdClusterConfig, netns_name
from runtime_helpers import BIN, TRAIN, events, named

from dlrover_hpc.localslurm import wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="SSH hosts in network namespaces need root"
)

# A whole job's bound. On a loaded 2-core CI machine one SSH job took 18 s to connect and 30 s to
# import torch in its workers, and ran out of a 120 s bound at step 1: bounds are generous.
JOB_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshdCluster]:
    """Four hosts (host1..host4) with sshd and key authentication, for the whole module."""
    # Test workers side by side (pytest -n) each bring up their own: a bridge, subnet and
    # link names of their own (the namespaces are private to the worker, tests/conftest.py).
    k = worker_index()
    config = SshdClusterConfig(
        hosts=4,
        state_dir=tmp_path_factory.mktemp("sshd"),
        **(
            {"bridge": f"dlhpc{k}-sshbr", "subnet": f"10.79.{k}", "veth_prefix": f"dlhpc{k}s"}
            if k
            else {}
        ),
    )
    hosts = SshdCluster(config)
    hosts.up()
    yield hosts
    hosts.down()
    left = [n for n in os.listdir("/run/netns") if n.startswith("dlhpc-ssh-")]
    assert not left and not Path(f"/sys/class/net/{config.bridge}").exists(), left


class Launch:
    """A ``dlrover-hpc launch`` subprocess; its stdout and stderr go to one file."""

    def __init__(self, work: Path, argv: Sequence[str], env: dict[str, str]) -> None:
        self.work = work
        self.log = work / "launch.out"
        self.started = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                list(argv), cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        raise AssertionError(f"launch did not end in {timeout_s} s:\n{self.output[-4000:]}")

    def wait_step(self, step: int, timeout_s: float = 180) -> None:
        wait_for(
            lambda: f": step {step} loss" in self.output or self.proc.poll() is not None,
            timeout_s=timeout_s,
            what=f"training to reach step {step}",
        )
        assert self.proc.poll() is None, self.output[-4000:]

    @property
    def job_dir(self) -> Path:
        return self.work / "job"


def launch(
    cluster: SshdCluster,
    work: Path,
    hostfile: str,
    run_args: Sequence[str],
    *,
    known_hosts: Path | None = None,
    master_opts: str = "",
    env: dict[str, str] | None = None,
) -> Launch:
    (work / "hosts.txt").write_text(hostfile)
    full_env = {
        **os.environ,
        "DLROVER_HPC_KNOWN_HOSTS": str(known_hosts or cluster.known_hosts),
        "DLROVER_HPC_SSH_CONFIG": str(cluster.ssh_config),
        "DLROVER_HPC_CONNECT_TIMEOUT": "10",  # 3 s: sshd forks too slowly under a loaded suite
        "DLROVER_HPC_MASTER_OPTS": master_opts,
        **(env or {}),
    }
    for name in ("DLROVER_HPC_TOKEN", "DLROVER_HPC_MASTER", "DLROVER_HPC_BLOCKLIST"):
        if env is None or name not in env:
            full_env.pop(name, None)
    argv = [
        str(BIN / "dlrover-hpc"),
        "launch",
        "--hostfile",
        str(work / "hosts.txt"),
        "--ssh-key",
        str(cluster.client_key),
        "--",
        f"--job-dir={work / 'job'}",
        *run_args,
    ]
    return Launch(work, argv, full_env)


def train(work: Path, *, steps: int, extra: Sequence[str] = ()) -> list[str]:
    (work / "ckpt").mkdir(exist_ok=True)
    return [
        str(TRAIN),
        f"--steps={steps}",
        "--step-time=0.1",
        f"--ckpt-dir={work / 'ckpt'}",
        "--ckpt-every=5",
        f"--result={work / 'result.json'}",
        f"--rank-log={work / 'ranks'}",
        *extra,
    ]


def assert_hosts_clean(cluster: SshdCluster, timeout_s: float = 30) -> None:
    """Nothing but each host's listening sshd is left: no session, helper, agent or worker."""

    def left() -> dict[str, list[tuple[int, str]]]:
        return {h: p for h in cluster.hosts if (p := cluster.processes(h))}

    try:
        wait_for(lambda: not left(), timeout_s=timeout_s, what="the hosts to be clean")
    except TimeoutError:
        raise AssertionError(f"processes left on the hosts: {left()}") from None


def last_round(job_dir: Path) -> list[str]:
    return named(events(job_dir), "rendezvous_complete")[-1]["nodes"]


def spare_of(job_dir: Path, hosts: Sequence[str]) -> str:
    """The host left out of the first round: the first hosts to join make it, and on a loaded
    machine the last in the hostfile is not always the last to join (cc22: host1 was)."""
    first = named(events(job_dir), "rendezvous_complete")[0]["nodes"]
    (spare,) = set(hosts) - set(first)
    return spare


def kill_agent(cluster: SshdCluster, host: str) -> None:
    pids = cluster.find(host, "dlrover-run")
    assert len(pids) == 1, cluster.processes(host)
    os.kill(pids[0], signal.SIGKILL)


# ------------------------------------------------------------------- jobs
def test_ddp_job_over_three_hosts(cluster: SshdCluster, tmp_path: Path) -> None:
    job = launch(
        cluster,
        tmp_path,
        "# two workers on host1 (slots), one on each of the others\nhost1 slots=2\nhost[2-3]\n",
        ["--nnodes=3:3", "--nproc-per-node=1", *train(tmp_path, steps=10)],
    )
    job.wait_step(2)
    # The job token reaches the agents through the helper's stdin, never a command line.
    token = (job.job_dir / "token").read_text().strip()
    commands = [cmd for h in cluster.hosts for _, cmd in cluster.processes(h)]
    assert any("dlrover-run" in cmd for cmd in commands)
    assert not [cmd for cmd in commands if token in cmd]
    assert job.wait(JOB_S) == 0, job.output[-4000:]
    assert json.loads((tmp_path / "result.json").read_text()) == {
        "final_step": 10,
        "world_size": 4,
        "restart_count": 0,
        "group_world_size": 3,
    }
    out = job.output
    assert "host1: step 10 loss" in out
    for host in ("host1", "host2", "host3"):  # every host's output, with its prefix
        assert f"{host}: " in out and f"[agent@{host}]" in out
    assert sorted(last_round(job.job_dir)) == ["host1", "host2", "host3"]
    placed = [json.loads(p.read_text()) for p in sorted((tmp_path / "ranks").glob("*.json"))]
    assert sorted(p["host"] for p in placed) == ["host1", "host1", "host2", "host3"]
    assert named(events(job.job_dir), "job_finished")[-1]["exit_code"] == 0
    assert_hosts_clean(cluster)


def test_killed_agent_hands_its_place_to_the_spare(cluster: SshdCluster, tmp_path: Path) -> None:
    job = launch(
        cluster,
        tmp_path,
        "host[1-4]\n",  # --nnodes=3:3: host4 is the hot spare
        ["--nnodes=3:3", "--nproc-per-node=1", *train(tmp_path, steps=40)],
    )
    job.wait_step(5)
    hosts = ["host1", "host2", "host3", "host4"]
    spare = spare_of(job.job_dir, hosts)
    wait_for(lambda: cluster.find(spare, "dlrover-run"), timeout_s=30, what="the spare agent")
    first = last_round(job.job_dir)
    assert len(first) == 3, first
    victim = first[1]
    kill_agent(cluster, victim)
    assert job.wait(JOB_S) == 0, job.output[-4000:]
    evs = events(job.job_dir)
    assert [e["node"] for e in named(evs, "node_lost")] == [victim]
    assert [e["node"] for e in named(evs, "node_admitted")] == [spare]
    assert sorted(last_round(job.job_dir)) == sorted(set(hosts) - {victim})
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["final_step"] == 40 and result["group_world_size"] == 3
    assert f"agent ended host={victim} exit_code=137 (killed by SIGKILL)" in job.output
    assert_hosts_clean(cluster)
    # A SIGKILLed agent cannot remove its checkpoint saver's socket (in the shared /tmp).
    job_id = json.loads((job.job_dir / "master.json").read_text())["job_id"]
    for stale in Path("/tmp").glob(f"dlrover-hpc-*-{job_id}-{victim}.sock"):
        stale.unlink()


def test_cut_link_hands_its_place_to_the_spare(cluster: SshdCluster, tmp_path: Path) -> None:
    job = launch(
        cluster,
        tmp_path,
        "host[1-4]\n",
        # 100 steps (10 s): a loaded machine may take seconds to see step 5 in the output
        ["--nnodes=3:3", "--nproc-per-node=1", *train(tmp_path, steps=100)],
        master_opts="--heartbeat-timeout=4",
    )
    hosts = ["host1", "host2", "host3", "host4"]
    victim = ""
    try:
        job.wait_step(5)
        spare = spare_of(job.job_dir, hosts)
        wait_for(lambda: cluster.find(spare, "dlrover-run"), timeout_s=30, what="the spare")
        victim = last_round(job.job_dir)[2]
        cluster.cut_link(victim)
        assert job.wait(JOB_S) == 0, job.output[-4000:]
    finally:
        if victim:
            cluster.heal_link(victim)
    evs = events(job.job_dir)
    lost = named(evs, "node_lost")
    # A cut link is silence: the link timeout (--link-timeout, 1 s) and the heartbeat timeout (4 s
    # here) race to notice it; either is right, a "connection closed" would not be.
    assert [e["node"] for e in lost] == [victim]
    assert lost[0]["reason"] in ("link timed out", "no heartbeat"), lost
    assert [e["node"] for e in named(evs, "node_admitted")] == [spare]
    assert sorted(last_round(job.job_dir)) == sorted(set(hosts) - {victim})
    assert json.loads((tmp_path / "result.json").read_text())["final_step"] == 100
    # host3's agent stops once it misses the master; its sshd session ends too.
    assert_hosts_clean(cluster, timeout_s=45)


def test_hardware_fault_blocklists_the_host(cluster: SshdCluster, tmp_path: Path) -> None:
    shared = tmp_path / "shared-blocklist.txt"
    job = launch(
        cluster,
        tmp_path,
        "host[1-4]\n",
        [
            "--nnodes=3:3",
            "--nproc-per-node=1",
            *train(
                tmp_path, steps=30, extra=("--fail-at-step=8", "--fail-rank=1", "--fail-mode=xid")
            ),
        ],
        env={"DLROVER_HPC_BLOCKLIST": str(shared)},
    )
    assert job.wait(JOB_S) == 0, job.output[-4000:]
    evs = events(job.job_dir)
    hardware = [e for e in named(evs, "worker_failed") if e["classification"] == "hardware"]
    assert len(hardware) == 1, named(evs, "worker_failed")
    bad = hardware[0]["node"]
    assert [e["node"] for e in named(evs, "node_quarantined")] == [bad]
    all_hosts = ["host1", "host2", "host3", "host4"]
    assert [e["node"] for e in named(evs, "node_admitted")] == [spare_of(job.job_dir, all_hosts)]
    assert bad not in last_round(job.job_dir)
    for blocklist in (job.job_dir / "blocklist.txt", shared):
        lines = [ln for ln in blocklist.read_text().splitlines() if not ln.startswith("#")]
        assert len(lines) == 1 and lines[0].startswith(f"{bad}  # "), lines
        assert "hardware" in lines[0] and "job launch-" in lines[0]
    assert_hosts_clean(cluster)

    # The next job never uses the host: with it gone, three hosts cannot make --nnodes=3:3.
    again = tmp_path / "again"
    again.mkdir()
    good = [h for h in all_hosts if h != bad][:2]
    hosts = "".join(f"{h}\n" for h in good)
    nxt = launch(
        cluster,
        again,
        hosts + f"{bad}\n",
        ["--nnodes=3:3", *train(again, steps=2)],
        env={"DLROVER_HPC_BLOCKLIST": str(shared)},
    )
    assert nxt.wait(60) == 1, nxt.output[-3000:]
    assert f"host skipped host={bad} blocklisted at {shared}:3" in nxt.output
    assert "only 2 usable host(s) of 3" in nxt.output
    assert f"{bad}: blocklisted ({shared}:3: " in nxt.output
    assert not (again / "job" / "master.json").exists()  # nothing started
    assert_hosts_clean(cluster)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("how", ["no-such-address", "link-down"])
def test_unreachable_host_is_named(cluster: SshdCluster, tmp_path: Path, how: str) -> None:
    bad = f"{cluster.config.subnet}.99" if how == "no-such-address" else "host3"
    if how == "link-down":
        cluster.cut_link("host3")
    try:
        job = launch(
            cluster,
            tmp_path,
            f"host1\nhost2\n{bad}\n",
            ["--nnodes=3:3", *train(tmp_path, steps=2)],
        )
        assert job.wait(60) == 1, job.output[-3000:]
    finally:
        cluster.heal_link("host3")
    took = time.monotonic() - job.started
    out = job.output
    assert f"{bad}: unreachable: " in out, out[-3000:]
    assert "only 2 reachable host(s) of 3" in out and "needs at least 3" in out
    assert took < 60, took  # the connect timeout (3 s) and start-up: 30.1 s at a load of 15-37
    assert not (tmp_path / "job" / "master.json").exists()
    assert_hosts_clean(cluster)  # the helpers already started on host1 and host2 are gone


def test_unknown_host_key_is_refused(cluster: SshdCluster, tmp_path: Path) -> None:
    known = cluster.write_known_hosts(tmp_path / "known_hosts", ["host1", "host3"])
    job = launch(
        cluster,
        tmp_path,
        "host[1-3]\n",
        ["--nnodes=3:3", *train(tmp_path, steps=2)],
        known_hosts=known,
    )
    assert job.wait(60) == 1, job.output[-3000:]
    assert (
        f"host2: the SSH host key is not trusted: no matching key in {known}; if host2 is the "
        f"right machine, add its key (check the fingerprint of 'ssh-keyscan host2', then append "
        f"it to {known})"
    ) in job.output
    assert job.output.count("host2: the SSH host key is not trusted") == 1
    assert_hosts_clean(cluster)


# ----------------------------------------------------------------- signals
@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)]
)
def test_stopping_the_launcher_leaves_nothing_behind(
    cluster: SshdCluster, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """Ctrl-C and SIGTERM are forwarded; even a SIGKILLed launcher leaves no remote process:
    the helpers see their channel close and stop the agents."""
    job = launch(
        cluster,
        tmp_path,
        "host[1-3]\n",
        ["--nnodes=3:3", "--nproc-per-node=1", *train(tmp_path, steps=500)],
    )
    job.wait_step(3)
    job.proc.send_signal(sig)
    assert job.wait(60) == code, job.output[-4000:]
    if sig is not signal.SIGKILL:
        assert f"{sig.name}: forwarding it to the agents" in job.output
        assert named(events(job.job_dir), "job_finished")[-1]["exit_code"] == 143
    assert_hosts_clean(cluster)
    assert netns_name("host1") in os.listdir("/run/netns")  # the hosts themselves stay up
