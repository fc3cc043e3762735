"""dlrover-run takes every torchrun flag (issue 46): its parser against the installed torch's
``torch.distributed.run.get_args_parser()``, so a torch release that adds a flag fails here until
the flag is declared in dlrover_hpc/settings.py with how dlrover-run treats it."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from dlrover_hpc import settings
from dlrover_hpc.agent.workers import virtual_local_rank_env
from dlrover_hpc.cli import parity, run, run_args, site_config
from dlrover_hpc.errors import ConfigError
from dlrover_hpc.settings import Command, Setting, Treatment

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def torchrun() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No DLROVER_HPC_* (our defaults) nor PET_* (torchrun's) from the machine running this."""
    for name in list(os.environ):
        if name.startswith((settings.PREFIX, "PET_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv(settings.SITE_CONFIG.env, "")
    monkeypatch.setenv("XDG_CONFIG_HOME", "/nonexistent")


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        flag: action
        for action in parser._actions
        if action.dest != "help"
        for flag in action.option_strings
    }


def _ours() -> argparse.ArgumentParser:
    return run_args.build_parser(site_config.Defaults(Command.RUN.value, env={}))


def _declared() -> dict[str, Setting[Any]]:
    return {s.key: s for s in settings.BY_COMMAND[Command.RUN] if s.torchrun is not None}


def test_every_torchrun_option_string_is_declared(torchrun: argparse.ArgumentParser) -> None:
    ours, declared = _options(_ours()), _declared()
    for flag, theirs in _options(torchrun).items():
        assert flag in ours, f"torchrun's {flag} is not a dlrover-run flag: declare it"
        setting = declared.get(ours[flag].dest)
        assert setting is not None, f"{flag}: dlrover-run's {ours[flag].dest} is not torchrun's"
        assert ours[flag].dest == theirs.dest, flag
        assert (ours[flag].nargs == 0) == (theirs.nargs == 0), f"{flag}: a switch in one only"


def test_every_declared_torchrun_flag_is_torchruns(torchrun: argparse.ArgumentParser) -> None:
    theirs = _options(torchrun)
    for setting in _declared().values():
        for flag in setting.flags:
            assert flag in theirs, f"{flag} is declared torchrun's but torch has no such flag"
    ours_only = {
        flag for s in settings.BY_COMMAND[Command.RUN] if s.torchrun is None for flag in s.flags
    }
    assert not ours_only & set(theirs), "a torchrun flag declared as dlrover-hpc's own"


def test_same_meaning_same_default(torchrun: argparse.ArgumentParser, clean_env: None) -> None:
    theirs = vars(torchrun.parse_args(["train.py"]))
    ours = vars(_ours().parse_args(["train.py"]))
    for key, setting in _declared().items():
        if setting.torchrun is settings.SAME:
            assert ours[key] == theirs[key], f"{setting.flag}: default {ours[key]!r} here, "
            f"{theirs[key]!r} in torchrun; declare it different(...) or match it"


def test_choices_agree(torchrun: argparse.ArgumentParser) -> None:
    ours = _options(_ours())
    for flag, theirs in _options(torchrun).items():
        assert set(ours[flag].choices or ()) == set(theirs.choices or ()), flag


def test_each_difference_says_why() -> None:
    for setting in _declared().values():
        parity_ = setting.torchrun
        assert parity_ is not None
        assert (parity_.treatment is Treatment.SAME) == (not parity_.why), setting.flag
    with pytest.raises(ValueError):
        settings.Parity(Treatment.IGNORED)


def test_max_restarts_help_says_per_job() -> None:
    assert "per job, not per agent" in settings.MAX_RESTARTS.help_for(Command.RUN)


def test_ignored_flags_say_so_in_help() -> None:
    assert settings.NODE_RANK.help_for(Command.RUN).startswith("torchrun's; ignored: ")


def test_ignored_flags_given_are_named_once(clean_env: None) -> None:
    args = run_args.parse_args(
        ["--node_rank=1", "--master-addr", "h0", "--rdzv-backend=c10d", "--run-path", "t.py"]
    )
    notices = run_args.ignored_notices(args)
    assert notices == (
        "--rdzv-backend=c10d ignored (torchrun's flag): the job master does the rendezvous "
        "(--rdzv-endpoint still says where to find or start it)",
        "--run-path ignored (torchrun's flag): each worker runs the script in a process of its "
        "own, as without --run-path: flash checkpoints and recovery need one per worker",
        "--node-rank=1 ignored (torchrun's flag): the job master assigns node ranks (in "
        "topology order)",
        "--master-addr=h0 ignored (torchrun's flag): MASTER_ADDR is node rank 0's address, "
        "chosen by the job master each round",
    )


def test_ignored_flags_at_their_defaults_say_nothing(clean_env: None) -> None:
    args = run_args.parse_args(["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT", "t.py"])
    assert run_args.ignored_notices(args) == ()


def test_run_warns_once_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_env: None
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    records: list[logging.LogRecord] = []
    seen_by_agent: list[list[logging.LogRecord]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    real_setup = run.setup_logging

    def setup(role: str) -> None:
        real_setup(role)
        logging.getLogger().addHandler(Keep())

    def agent(config: object) -> int:
        seen_by_agent.append(list(records))
        return 0

    monkeypatch.setattr(run, "setup_logging", setup)
    monkeypatch.setattr(run, "_run_agent", agent)
    try:
        assert run.main(["--master-port=29500", "--event_log_handler=console", str(script)]) == 0
    finally:
        logging.getLogger().handlers[:] = []
    warned = [r.getMessage().split(" ")[0] for r in records if r.levelno == logging.WARNING]
    assert warned == ["--event-log-handler=console", "--master-port=29500"]
    assert seen_by_agent == [records]  # logged once, before the agent starts


def test_refused_flag_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str], clean_env: None
) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_args.parse(["--numa_binding=socket", "train.py"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "dlrover-run: error: --numa-binding=socket (torchrun's): dlrover-run does not bind "
        "workers to CPUs; drop it and bind the job step instead (srun --cpu-bind=..., or numactl "
        "in a --no-python wrapper)\n"
    )


def test_refused_flag_from_the_launcher_too(clean_env: None) -> None:
    args = run_args.parse_args(["--numa-binding=node", "train.py"])
    with pytest.raises(ConfigError, match="--numa-binding=node"):
        run_args.config_from_args(args)


@pytest.mark.parametrize(
    ("local_rank", "visible", "env"),
    [
        (1, None, {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1"}),
        (1, "4,6", {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "6"}),
        (0, "GPU-a, GPU-b", {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "GPU-a"}),
    ],
)
def test_virtual_local_rank_env(local_rank: int, visible: str | None, env: dict[str, str]) -> None:
    assert virtual_local_rank_env(local_rank, visible) == env


def test_virtual_local_rank_needs_a_gpu_per_worker() -> None:
    with pytest.raises(ConfigError, match="lower --nproc-per-node to 2"):
        virtual_local_rank_env(2, "4,6")


def test_virtual_local_rank_reaches_the_config(clean_env: None) -> None:
    args = run_args.parse_args(["--virtual_local_rank", "train.py"])
    assert run_args.config_from_args(args).virtual_local_rank is True


def test_docs_page_is_current() -> None:
    spec = importlib.util.spec_from_file_location("reference", REPO / "docs" / "reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    path = REPO / "docs" / "reference" / "torchrun.md"
    page = path.read_text()
    _, make = reference.GENERATORS["torchrun"]
    assert reference.with_generated(page, "torchrun", make()) == page, (
        "run: python docs/reference.py --write"
    )


def test_table_has_a_row_per_torchrun_flag(torchrun: argparse.ArgumentParser) -> None:
    table = parity.table()
    for flag in _options(torchrun):
        assert f"`{flag}`" in table, flag
