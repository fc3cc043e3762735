"""The environment dlrover-hpc's processes hand one another (dlrover_hpc.environ)."""

from __future__ import annotations

from dlrover_hpc import environ
from dlrover_hpc.environ import WorkerEnv


def test_a_worker_reads_back_what_its_agent_wrote() -> None:
    sent = WorkerEnv(
        master="node1:29400",
        job_dir="/jobs/7",
        job_id="7",
        node_name="node1",
        saver_socket="/dev/shm/saver.sock",
        progress_file="/dev/shm/progress-0",
        forward_timing=True,
        round=3,
    )
    env = sent.to_environ()
    assert env[environ.MASTER] == "node1:29400" and env[environ.ROUND] == "3"
    assert WorkerEnv.from_environ(env) == sent


def test_unset_values_are_left_out_and_read_as_none() -> None:
    env = WorkerEnv(job_id="standalone").to_environ()
    assert env == {environ.JOB_ID: "standalone", environ.FORWARD_TIMING: "0"}
    back = WorkerEnv.from_environ({**env, environ.ROUND: "x"})
    assert back.saver_socket is None and back.round is None and not back.forward_timing


def test_every_name_carries_the_prefix_a_launcher_forwards() -> None:
    names = [v for k, v in vars(environ).items() if k.isupper() and isinstance(v, str)]
    assert len(names) > 20
    assert all(n.startswith(environ.PREFIX) for n in names)
    assert environ.name("max-restarts") == environ.PREFIX + "MAX_RESTARTS"


def test_the_prefix_is_spelt_out_in_at_most_three_modules() -> None:
    """Every other module takes its variables' names from environ (settings derives the
    settings' variables from its PREFIX)."""
    from pathlib import Path

    import dlrover_hpc

    package = Path(dlrover_hpc.__file__).parent
    spelling = "DLROVER" + "_HPC_"
    spelt = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if spelling in path.read_text()
    )
    assert spelt == ["environ.py"], spelt


def test_a_name_that_is_also_a_setting_is_that_settings_variable() -> None:
    from dlrover_hpc import settings

    assert settings.MASTER.env == environ.MASTER
    assert settings.JOB_DIR.env == environ.JOB_DIR
    assert settings.REQUEUE_BY.env == environ.REQUEUE_BY
