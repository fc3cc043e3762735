"""Goodput you can see (issue 15) on the real local Slurm: a job with a worker kill and a node
loss, scraped by a real Prometheus while it runs, watched with ``status --watch``, and
reported afterwards from its event log alone."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
from pathlib import Path

import pytest
from harness.prometheus import Prometheus, ensure_installed
from runtime_helpers import BIN, TRAIN, events, named, sbatch, timing_log, wait_job

from dlrover_hpc.localslurm import LocalSlurm, wait_for
from dlrover_hpc.report.analysis import analyze
from dlrover_hpc.report.plot import plot

pytestmark = pytest.mark.slurm
FLASH = TRAIN.parent / "train_flash_ckpt.py"
METRICS_PORT = 9464
STEPS = 360
DISTURBING = {"worker_failed", "node_lost", "hang_detected", "node_admitted", "master_recovered"}


def _wait_step(work: Path, step: int) -> None:
    wait_for(
        lambda: any(s >= step for _, s in timing_log(work)),
        timeout_s=180,
        what=f"training to reach step {step}",
    )


def independent_goodput(evs: list[dict]) -> float:
    """docs/guide/goodput.md's definition, written again without the report's code: the final
    step (the job trained every step once) x the median over steps of the time per step between two
    progress events of one round (not its first; no fault between; blocking taken out)."""
    start = next(e["time"] for e in evs if e["event"] == "job_started")
    end = next(e["time"] for e in evs if e["event"] == "job_finished")
    blocking: dict[int, float] = {}
    for e in evs:
        if e["event"] == "checkpoint_saved":
            blocking[e["step"]] = max(blocking.get(e["step"], 0.0), e["blocking_s"])
    faults = [e["time"] for e in evs if e["event"] in DISTURBING]
    per_step: list[float] = []
    for _, group in itertools.groupby(
        (e for e in evs if e["event"] == "training_progress"), key=lambda e: e["round"]
    ):
        samples = [(e["at"], e["step"]) for e in group][1:]
        for (t0, s0), (t1, s1) in itertools.pairwise(samples):
            if s1 > s0 and not any(t0 < f <= t1 for f in faults):
                blocked = sum(b for s, b in blocking.items() if s0 < s <= s1)
                per_step += [(t1 - t0 - blocked) / (s1 - s0)] * (s1 - s0)
    steps = max(e["step"] for e in evs if e["event"] == "training_progress")
    return steps * statistics.median_low(per_step) / (end - start)


def test_report_metrics_and_watch_of_a_job_with_a_worker_kill_and_a_node_loss(
    local_slurm: LocalSlurm, shared_tmp: Path
) -> None:
    ensure_installed()
    work = shared_tmp
    (work / "ckpt").mkdir()
    job = sbatch(
        work,
        4,
        "--nnodes=3:4",
        "--nproc-per-node=1",
        "--max-restarts=2",
        str(FLASH),
        f"--steps={STEPS}",
        f"--ckpt-dir={work / 'ckpt'}",
        "--save-every=2",
        "--persist-every=20",
        "--step-time=0.1",
        "--fail-at-step=40",
        "--fail-rank=1",
        f"--timing-log={work / 'timing.log'}",
        master_opts=f"--metrics-port={METRICS_PORT}",
    )
    job_dir = work / ".dlrover-hpc" / job
    target = f"{local_slurm.config.address('node1')}:{METRICS_PORT}"
    dlrover_hpc = str(BIN / "dlrover-hpc")
    watch_argv = [dlrover_hpc, "status", "--watch=1", "--job-dir", str(job_dir)]
    watch = subprocess.Popen(  # from node2: it resolves the master's host name, and survives
        [*local_slurm.node_exec_argv("node2"), *watch_argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with Prometheus([target], workdir=work / "prometheus", scrape_interval_s=1.0) as prom:
            _wait_step(work, 60)  # past the worker kill at 40 and its restart
            assert prom.wait_for_value("dlrover_hpc_restarts_total >= 1", timeout_s=60) == 1.0
            assert prom.wait_for_value('dlrover_hpc_nodes{state="active"}') == 4.0
            # (a round's first report can be its workers' start, step 0, before the restore)
            assert prom.wait_for_value("dlrover_hpc_step > 0") > 0
            # once a round has trained for a few step reports (every 5 s)
            assert 0 < prom.wait_for_value("dlrover_hpc_goodput", timeout_s=60) <= 1
            saves = prom.wait_for_value("dlrover_hpc_checkpoint_save_seconds_count")
            assert saves > 0
            local_slurm.kill_node("node4")  # its agent and workers, as if it lost power
            prom.wait_for_value('dlrover_hpc_nodes{state="lost"} == 1', timeout_s=60)
            fields = wait_job(job, timeout_s=420)
        watched, _ = watch.communicate(timeout=60)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
        subprocess.run(["scancel", job], check=False, timeout=30)  # a no-op once it ended
        local_slurm.restart_node("node4")
    out = (work / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out[-4000:]
    evs = events(job_dir)
    assert [e["node"] for e in named(evs, "node_lost")] == ["node4"]
    assert any(e["signal"] == "SIGKILL" for e in named(evs, "worker_failed"))
    assert watch.returncode == 0, watched[-3000:]
    assert "the job finished" in watched and "node1" in watched, watched[-3000:]

    png = work / "timeline.png"
    reported = subprocess.run(
        [dlrover_hpc, "report", "--job-dir", str(job_dir), "--json", "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(reported.stdout)
    assert report["steps"] == STEPS and report["restarts"] == 1, report
    expected = independent_goodput(evs)
    assert report["goodput"] == pytest.approx(expected, rel=0.01), (report, expected)
    # And against what rank 0 itself timed: distinct steps x its median step, over the wall.
    # Two estimators of one step time: the report's median is over 5-second averages, this one
    # over single steps, whose spread on a loaded 2-core machine is wide (CI on d07547b: 5.1 %
    # apart). The exact check of the report is the 1 % one above; this one catches a report
    # that is off by a factor, such as a step time counted twice or blocking never taken out.
    timing = timing_log(work)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(timing) if b[1] == a[1] + 1]
    start = named(evs, "job_started")[0]["time"]
    truth = STEPS * statistics.median(gaps) / (named(evs, "job_finished")[-1]["time"] - start)
    assert report["goodput"] == pytest.approx(truth, rel=0.12), (report["goodput"], truth)
    lost = report["lost_s"]
    assert report["useful_s"] + sum(lost.values()) == pytest.approx(report["wall_s"], abs=0.01)
    assert lost["restarts"] + lost["rendezvous"] > 0 and lost["start-up"] > 0, lost
    assert {n["node"] for n in report["nodes"]} == {"node1", "node2", "node3", "node4"}

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = plot(analyze(evs), work / "again.png")
    assert sorted(summary.lanes) == ["node1", "node2", "node3", "node4"]
    assert summary.markers.get("failure", 0) >= 1 and summary.markers.get("lost") == 1
    assert summary.markers.get("checkpoint", 0) >= STEPS // 20 - 1
    text = subprocess.run(
        [dlrover_hpc, "report", "--job-dir", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    print(text)  # the closing note quotes it
    assert f"goodput {report['goodput']:.1%}" in text and "node4" in text
