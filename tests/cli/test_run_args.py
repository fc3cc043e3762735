"""dlrover-run and dlrover-hpc: every documented flag, and clear exit-2 errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dlrover_hpc.cli import run_args

TORCHRUN_FLAGS = [
    "--nnodes",
    "--nproc-per-node",
    "--nproc_per_node",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv-id",
    "--rdzv-conf",
    "--standalone",
    "--max-restarts",
    "--max_restarts",
    "--monitor-interval",
    "--start-method",
    "--event-log-handler",
    "--role",
    "--module",
    "--no-python",
    "--run-path",
    "--log-dir",
    "--redirects",
    "--tee",
    "--local-ranks-filter",
    "--node-rank",
    "--master-addr",
    "--master-port",
    "--local-addr",
    "--logs-specs",
    "--shutdown-timeout",
    "--signals-to-handle",
]
OUR_FLAGS = ["--master", "--network-check", "--exclude-straggler", "--node-unit", "--job-dir"]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            f"import sys; from dlrover_hpc.cli.{argv[0]} import main; sys.exit(main(sys.argv[1:]))",
            *argv[1:],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dlrover_run_help_lists_every_flag() -> None:
    out = _run("run", "--help")
    assert out.returncode == 0
    for flag in TORCHRUN_FLAGS + OUR_FLAGS:
        assert flag in out.stdout, flag


def test_dlrover_hpc_help_lists_subcommands() -> None:
    out = _run("main", "--help")
    assert out.returncode == 0
    for sub in ("master", "topology", "drain", "launch", "status", "local-slurm"):
        assert sub in out.stdout, sub
    master = _run("main", "master", "--help")
    for flag in (
        "--host",
        "--port",
        "--nnodes",
        "--node-unit",
        "--topology",
        "--drain",
        "--job-dir",
    ):
        assert flag in master.stdout, flag
    assert "DLROVER_HPC_" in master.stdout


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--nnodes=4:2", "t.py"],
            "--nnodes=4:2: the minimum is larger than the maximum; "
            "write MIN:MAX with MIN <= MAX, e.g. --nnodes=2:4",
        ),
        (["--nnodes=0", "t.py"], "--nnodes=0:0: the minimum must be at least 1"),
        (["--nnodes=a:b", "t.py"], "--nnodes=a:b: expected a node count N or a range MIN:MAX"),
        (["--nnodes=1:2:3", "t.py"], "expected a node count N or a range MIN:MAX"),
        (
            ["--standalone", "--master=h:1", "t.py"],
            "--standalone runs its own in-process master; drop --master",
        ),
        (["--standalone", "--nnodes=2", "t.py"], "--standalone is for one node"),
        (["--hang-timeout=-1", "t.py"], "--hang-timeout=-1: must be auto, 0 (off) or seconds"),
        (["--hang-timeout=soon", "t.py"], "--hang-timeout=soon: must be auto, 0 (off) or seconds"),
        (["--straggler-factor=1", "t.py"], "--straggler-factor=1: must be 0 (off) or more than 1"),
        (
            ["--nnodes=2:4", "--node-unit=8", "t.py"],
            "--node-unit=8 is larger than --nnodes maximum 4",
        ),
        (["--nnodes=3:3", "--node-unit=2", "t.py"], "no multiple of 2 lies between 3 and 3"),
        (["--node-unit=0", "t.py"], "--node-unit=0: must be at least 1"),
        (["--max-restarts=-1", "t.py"], "--max-restarts=-1: must be 0 or more"),
        (["--nproc-per-node=zero", "t.py"], "--nproc-per-node=zero: expected a number"),
        (["--nproc-per-node=0", "t.py"], "needs at least 1 worker per node"),
        (["--master=nohostport", "t.py"], "--master=nohostport: expected HOST:PORT"),
        (["--module", "--no-python", "t.py"], "--module and --no-python exclude each other"),
        (["--redirects=9", "t.py"], "--redirects=9: expected 0, 1, 2, 3"),
        (["--rdzv-conf=novalue", "t.py"], "--rdzv-conf=novalue: expected KEY=VALUE"),
        (["--monitor-interval=0", "t.py"], "--monitor-interval=0.0: must be > 0"),
    ],
)
def test_bad_flag_combinations_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        run_args.parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flags_message_and_exit_code_in_a_real_process() -> None:
    out = _run("run", "--nnodes=4:2", "t.py")
    assert out.returncode == 2
    assert "dlrover-run: error: --nnodes=4:2: the minimum is larger than the maximum" in out.stderr
    out = _run("main", "master", "--nnodes=3:1")
    assert out.returncode == 2
    assert "dlrover-hpc master: error: --nnodes=3:1" in out.stderr


@pytest.fixture
def in_script_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds train.py (dlrover-run checks that the script exists)."""
    (tmp_path / "train.py").write_text("print('hello')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.usefixtures("in_script_dir")
def test_good_flags_parse_both_spellings() -> None:
    cfg = run_args.parse(
        [
            "--nnodes=2:4",
            "--nproc_per_node=2",
            "--max_restarts=5",
            "--node-unit=2",
            "--network-check",
            "--exclude-straggler",
            "--master=node1:29400",
            "--tee=3",
            "--redirects=0:1,1:2",
            "train.py",
            "--steps",
            "10",
        ]
    )
    assert (cfg.nnodes.min, cfg.nnodes.max) == (2, 4)
    assert cfg.nproc_per_node == 2
    assert cfg.max_restarts == 5
    assert cfg.master == ("node1", 29400)
    assert cfg.training_script == "train.py"
    assert cfg.training_script_args == ("--steps", "10")


@pytest.mark.usefixtures("in_script_dir")
def test_flags_come_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLROVER_HPC_MASTER", "node9:1234")
    monkeypatch.setenv("DLROVER_HPC_NNODES", "2:3")
    cfg = run_args.parse(["train.py"])
    assert cfg.master == ("node9", 1234)
    assert (cfg.nnodes.min, cfg.nnodes.max) == (2, 3)
    cfg = run_args.parse(["--nnodes=1", "train.py"])  # the flag wins
    assert cfg.nnodes.max == 1


@pytest.mark.usefixtures("in_script_dir")
def test_each_injection_has_its_own_switch_and_transparent_turns_off_all(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dlrover_hpc import injections

    assert run_args.parse(["train.py"]).off == frozenset()
    names = {i.name for i in injections.ALL}
    assert names == {"prewarm", "worker_hooks", "usr1_hold", "slurm_env_rewrite", "gc_handling"}
    for inj in injections.ALL:  # by flag, each on its own
        assert run_args.parse([inj.flag, "train.py"]).off == {inj.name}
    assert run_args.parse(["--transparent", "train.py"]).off == names
    monkeypatch.setenv(injections.WORKER_HOOKS.env, "1")  # by environment
    assert run_args.parse(["train.py"]).off == {"worker_hooks"}
    monkeypatch.delenv(injections.WORKER_HOOKS.env)
    monkeypatch.setenv(injections.TRANSPARENT_ENV, "yes")
    assert run_args.parse(["train.py"]).off == names
    monkeypatch.delenv(injections.TRANSPARENT_ENV)
    toml = tmp_path / "c.toml"  # by TOML key
    toml.write_text("[run]\nno_prewarm = true\nno_usr1_hold = true\n")
    assert run_args.parse([f"--config={toml}", "train.py"]).off == {"prewarm", "usr1_hold"}
    # the worker is told under the same names, and reads them
    env = injections.worker_env({"worker_hooks", "gc_handling"})
    assert env == {"DLROVER_HPC_NO_WORKER_HOOKS": "1", "DLROVER_HPC_NO_GC_HANDLING": "1"}
    assert not injections.enabled(injections.WORKER_HOOKS, env)
    assert injections.enabled(injections.USR1_HOLD, env)
