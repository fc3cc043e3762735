"""``dlrover-hpc report`` as a user runs it: the console script on a job directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli.test_errors import one_line_error, run

pytestmark = pytest.mark.timeout(120)

T0 = 1_800_000_000.0


def _job_dir(tmp_path: Path) -> Path:
    job = tmp_path / ".dlrover-hpc" / "77"
    job.mkdir(parents=True)
    lines = [
        {"time": T0, "event": "job_started", "job_id": "77"},
        {"time": T0 + 1, "event": "node_joined", "node": "n1", "agent": "n1-1"},
        {"time": T0 + 2, "event": "rendezvous_complete", "round": 1, "nodes": ["n1"]},
        *[
            {
                "time": T0 + 3 + i,
                "event": "training_progress",
                "round": 1,
                "step": 10 * i,
                "at": T0 + 3 + i,
            }
            for i in range(8)
        ],
        {"time": T0 + 11, "event": "job_finished", "exit_code": 0, "restart_count": 0},
    ]
    (job / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    return job


def test_report_prints_tables_json_and_a_plot(tmp_path: Path) -> None:
    job = _job_dir(tmp_path)
    text = run("dlrover-hpc", "report", "--job-dir", str(job), cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "job 77 (finished, exit code 0): goodput 63.6%" in text.stdout  # 70 x 0.1 s / 11 s
    assert "Where the wall time went" in text.stdout and "n1" in text.stdout
    out = run(
        "dlrover-hpc", "report", "--job-dir", str(job), "--json", "--plot", "t.png", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["steps"], report["goodput"], report["wall_s"]) == (70, 0.6364, 11.0)
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_report_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    one_line_error(
        run("dlrover-hpc", "report", "--job-dir", str(missing), cwd=tmp_path), 2, str(missing)
    )
    job = _job_dir(tmp_path)
    events = job / "events.jsonl"
    lines = events.read_text().splitlines()
    events.write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    one_line_error(
        run("dlrover-hpc", "report", "--job-dir", str(job), cwd=tmp_path),
        2,
        f"{events}:2: not an event",
        "remove the line",
    )
    events.write_text("\n".join(lines) + "\n")
    one_line_error(
        run(
            "dlrover-hpc",
            "report",
            "--job-dir",
            str(job),
            "--plot",
            "/nonexistent/t.png",
            cwd=tmp_path,
        ),
        2,
        "cannot write the plot to /nonexistent/t.png",
        "--plot",
    )
    (job / "events.jsonl").unlink()
    one_line_error(
        run("dlrover-hpc", "report", "--job-dir", str(job), cwd=tmp_path),
        2,
        "events.jsonl does not exist",
    )
