"""The TOML configuration against real files: the site's, the user's and ``--config``, under the
environment and the flags; every mistake names the file, the line and the fix (exit 2)."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli.test_errors import BIN, REPO, _clean_env, one_line_error, run
from dlrover_hpc.cli import commands, main, run_args
from dlrover_hpc.cli.site_config import Source, load, settings_of
from dlrover_hpc.cli.toml_lines import locate
from dlrover_hpc.config import MasterConfig

pytestmark = pytest.mark.timeout(120)


@dataclass
class Files:
    """The three files of one test, in tmp_path, and the directory the commands run in."""

    site: Path
    user: Path
    config: Path
    work: Path

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment that points the commands at these files."""
        return _clean_env(
            DLROVER_HPC_SITE_CONFIG=str(self.site),
            XDG_CONFIG_HOME=str(self.user.parent.parent),
            **extra,
        )


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Files]:
    for name in list(os.environ):
        if name.startswith(("DLROVER_HPC_", "SLURM_")):
            monkeypatch.delenv(name)
    found = Files(
        site=tmp_path / "etc" / "config.toml",
        user=tmp_path / "xdg" / "dlrover-hpc" / "config.toml",
        config=tmp_path / "job.toml",
        work=tmp_path / "work",
    )
    for path in (found.site, found.user, found.work / "train.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
    found.site.write_text("")
    (found.work / "train.py").write_text("print('hello')\n")
    monkeypatch.setenv("DLROVER_HPC_SITE_CONFIG", str(found.site))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(found.work)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield found
    root.handlers[:], root.level = handlers, level  # main() sets up logging


def _source(args: argparse.Namespace, key: str) -> str:
    return str(args.origins[key].describe())


# ------------------------------------------------------------------ precedence
def test_run_precedence_peeling_off_each_layer(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_restarts set by all five layers; each one removed in turn shows the next."""
    files.site.write_text("[run]\nmax_restarts = 1\n")
    files.user.write_text("# mine\n[run]\n\nmax_restarts = 2\n")
    files.config.write_text('[master]\ndrain = "off"\n\n[run]\nmax_restarts = 6\n')
    monkeypatch.setenv("DLROVER_HPC_MAX_RESTARTS", "4")
    flag, config = ["--max-restarts=5"], ["--config", str(files.config)]

    def parsed(*argv: str) -> tuple[int, str]:
        args = run_args.parse_args([*argv, "train.py"])
        assert run_args.parse([*argv, "train.py"]).max_restarts == args.max_restarts
        return args.max_restarts, _source(args, "max_restarts")

    assert parsed(*config, *flag)[0] == 5
    assert parsed(*config) == (4, "env DLROVER_HPC_MAX_RESTARTS")
    monkeypatch.delenv("DLROVER_HPC_MAX_RESTARTS")
    assert parsed(*config) == (6, f"{files.config}:5")
    monkeypatch.setenv("DLROVER_HPC_CONFIG", str(files.config))  # the same layer, by name
    assert parsed() == (6, f"{files.config}:5")
    monkeypatch.delenv("DLROVER_HPC_CONFIG")
    assert parsed() == (2, f"{files.user}:4")
    files.user.unlink()
    assert parsed() == (1, f"{files.site}:2")
    monkeypatch.setenv("DLROVER_HPC_SITE_CONFIG", "")  # empty: no site file
    assert parsed() == (3, "default")  # the built-in one


def test_master_precedence_peeling_off_each_layer(
    files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through ``dlrover-hpc master``'s own entry point, up to its MasterConfig."""
    seen: list[tuple[MasterConfig, str]] = []

    def master(args: argparse.Namespace) -> int:  # instead of serving a job
        seen.append((commands.master_config(args), _source(args, "max_restarts")))
        return 0

    monkeypatch.setattr(commands, "_master", master)
    files.site.write_text('[master]\nmax_restarts = 1\ndrain = "quarantine"\n')
    files.user.write_text("[master]\nmax_restarts = 2\n")
    files.config.write_text("[master]\n'max_restarts' = 6  # quoted key\n")
    monkeypatch.setenv("DLROVER_HPC_MAX_RESTARTS", "4")
    flag, config = ["--max-restarts=5"], ["--config", str(files.config)]

    def parsed(*argv: str) -> tuple[int, str]:
        seen.clear()
        assert main.main(["master", *argv]) == 0
        (cfg, source), *_ = seen
        assert cfg.drain.value == "quarantine"  # from the site file all along
        return cfg.max_restarts, source

    assert parsed(*config, *flag)[0] == 5
    assert parsed(*config) == (4, "env DLROVER_HPC_MAX_RESTARTS")
    monkeypatch.delenv("DLROVER_HPC_MAX_RESTARTS")
    assert parsed(*config) == (6, f"{files.config}:2")
    assert parsed() == (2, f"{files.user}:2")
    files.user.unlink()
    assert parsed() == (1, f"{files.site}:2")


def test_switches_from_files_env_and_flags(files: Files, monkeypatch: pytest.MonkeyPatch) -> None:
    files.user.write_text("[run]\nnetwork_check = true\nmodule = false\n")
    args = run_args.parse_args(["train.py"])
    assert (args.network_check, args.module) == (True, False)
    monkeypatch.setenv("DLROVER_HPC_NETWORK_CHECK", "0")  # the environment turns it off again
    assert run_args.parse_args(["train.py"]).network_check is False
    files.user.write_text("[master]\nrequeue = false\n")
    parser = main.build_parser(load(None, run_args.section_parsers()))
    assert parser.parse_args(["master"]).requeue is False
    assert parser.parse_args(["master", "--requeue"]).requeue is True


def test_every_flag_of_both_commands_can_be_set_in_a_file(files: Files) -> None:
    """Each flag's default goes through the files: a file that sets every key to a valid
    value is the source of every one of them."""
    lines = []
    for section, parser in run_args.section_parsers().items():
        keys = settings_of(parser)
        origins = parser.get_default("origins")
        assert set(origins) == set(keys), section  # every flag's default is looked up
        lines.append(f"[{section}]")
        for key, action in keys.items():
            lines.append(f"{key} = {_valid(action)}")
    files.config.write_text("\n".join(lines) + "\n")
    loaded = load(str(files.config), run_args.section_parsers())
    for section in ("run", "master"):
        origins = run_args.section_parser(section, loaded).get_default("origins")
        sources = {key: origin.source for key, origin in origins.items()}
        assert set(sources.values()) == {Source.FILE}, (section, sources)


def _valid(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "true"
    if action.choices:
        return f'"{next(iter(action.choices))}"'
    default = action.default
    if action.type in (int, float):
        return str(default) if default is not None else "1"
    return f'"{default}"' if default else '"x"'


# ------------------------------------------------------------------ mistakes in a file
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[run]\nmax_restarts = 7\n\nnnodes 4\n",
            "{f}:4: not valid TOML: Expected '=' after a key in a key/value pair (column 8); "
            "fix: write key = value lines under [run] or [master], strings in quotes, e.g. "
            'drain = "quarantine"',
        ),
        (
            '[run]\njob_dir = "/scratch\n',
            "{f}:2: not valid TOML: Illegal character '\\n' (column 20); fix:",
        ),
        (
            "# a comment\n[run]\nmax_restart = 7\n",
            "{f}:3: [run] max_restart: dlrover-run has no such flag; fix: did you mean "
            "max_restarts?",
        ),
        (
            "[master]\nheartbeat-timeout = 5\n",
            "{f}:2: [master] heartbeat-timeout: dlrover-hpc master has no such flag; fix: write "
            "it with underscores: heartbeat_timeout",
        ),
        (
            "[master]\nfrobnicate = 1\n",
            "{f}:2: [master] frobnicate: dlrover-hpc master has no such flag; fix: the keys are "
            "dlrover-hpc master's long flags with underscores (see 'dlrover-hpc config show "
            "master')",
        ),
        (
            "[run]\nmax_restarts = 1\n\n[runn]  # typo\nnnodes = 2\n",
            "{f}:4: unknown section [runn]; fix: did you mean [run]? the sections are [run] "
            "(dlrover-run), [master] (dlrover-hpc master)",
        ),
        (
            "max_restarts = 7\n[run]\n",
            "{f}:1: max_restarts = 7 is outside a section; fix: put it under [run] or [master]",
        ),
        (
            "topology = 'a.conf'\n",
            '{f}:1: topology = "a.conf" is outside a section; fix: put it under [master]',
        ),
        ("run = 3\n", "{f}:1: run = 3: [run] is a section; fix: write [run] on a line"),
        (
            '[run]\nmax_restarts = "7x"\n',
            "{f}:2: [run] max_restarts = \"7x\": --max-restarts: invalid int value: '7x'; "
            "fix: write a whole number, e.g. max_restarts = 3",
        ),
        (
            "[run]\nlink_timeout = 'soon'\n",
            "{f}:2: [run] link_timeout = \"soon\": --link-timeout: invalid float value: 'soon'; "
            "fix: write a number, e.g. link_timeout = 1",
        ),
        (
            '[master]\ndrain = "drain"\n',
            "{f}:2: [master] drain = \"drain\": --drain: invalid choice: 'drain' (choose from "
            "'scontrol', 'quarantine', 'off'); fix: write one of \"scontrol\", \"quarantine\", "
            '"off", e.g. drain = "scontrol"',
        ),
        (
            "[run]\nstart_method = 'thread'\n",
            "{f}:2: [run] start_method = \"thread\": --start-method: invalid choice: 'thread'",
        ),
        (
            '[run]\nnetwork_check = "yes"\n',
            '{f}:2: [run] network_check = "yes": --network-check: a switch takes true or false; '
            "fix: write network_check = true (or false)",
        ),
        (
            "[run]\nmax_restarts = true\n",
            "{f}:2: [run] max_restarts = true: --max-restarts: expected a whole number, not "
            "true/false; fix: write a whole number",
        ),
        (
            "[master]\nnnodes = [1, 4]\n",
            "{f}:2: [master] nnodes = [...]: --nnodes: expected a string, not a list; fix:",
        ),
        (
            "[run]\ntraining_script = 'train.py'\n",
            "{f}:2: [run] training_script: the training script is given on the command line; "
            "fix: remove this line",
        ),
        (
            "[run]\nconfig = 'other.toml'\n",
            "{f}:2: [run] config: a file cannot name another; pass --config FILE or set "
            "DLROVER_HPC_CONFIG; fix: remove this line",
        ),
        (
            "run.max_restarts = 1\nrun.max_restart = 2\n",
            "{f}:2: [run] max_restart: dlrover-run has no such flag; fix: did you mean "
            "max_restarts?",
        ),
        (
            '[run]\nrole = """\nmax_restart = 1\n"""\n\n[run . "extra"]\nx = 1\n',
            "{f}:6: [run] extra: dlrover-run has no such flag",
        ),
        (b"[run]\nrole = 'caf\xe9'\n", "{f}:2: not UTF-8 text; fix: save the file as UTF-8"),
    ],
)
def test_a_mistake_names_the_file_line_and_fix(
    files: Files,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    text: str | bytes,
    message: str,
) -> None:
    if isinstance(text, bytes):
        files.config.write_bytes(text)
    else:
        files.config.write_text(text)
    expected = message.format(f=files.config)
    for argv in (["--config", str(files.config), "train.py"], ["train.py"]):
        if argv == ["train.py"]:
            monkeypatch.setenv("DLROVER_HPC_CONFIG", str(files.config))  # the same, by name
        with pytest.raises(SystemExit) as exc:
            run_args.parse(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dlrover-run: error: {expected}"), err
        assert err.count("\n") == 1, err
    # dlrover-hpc finds it too (both sections of every file are checked by every command)
    assert main.main(["config", "show"]) == 2
    assert capsys.readouterr().err.startswith(f"dlrover-hpc config show: error: {expected}")


def test_every_layer_is_checked_before_any_is_used(
    files: Files, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistake in the site's file fails the command even where the flag, the user's file and
    --config set the same key: nothing is half-applied."""
    files.site.write_text("[master]\nmax_restarts = 'many'\n")
    files.user.write_text("[master]\nmax_restarts = 2\n")
    files.config.write_text("[master]\nmax_restarts = 3\n")
    assert main.main(["master", "--config", str(files.config), "--max-restarts=5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dlrover-hpc master: error: {files.site}:2: [master] max_restarts = ")


def test_values_that_do_not_combine_name_their_file_line_or_variable(
    files: Files, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked when the command runs, by the flag's own check; the error says where."""
    files.user.write_text('[run]\nnnodes = "4:2"\n\n[master]\nnnodes = "3:1"\n')
    with pytest.raises(SystemExit):
        run_args.parse(["train.py"])
    assert capsys.readouterr().err == (
        f'dlrover-run: error: {files.user}:2: [run] nnodes = "4:2": --nnodes=4:2: the minimum '
        "is larger than the maximum; write MIN:MAX with MIN <= MAX, e.g. --nnodes=2:4; fix: "
        "change it there, or override it with --nnodes\n"
    )
    assert run_args.parse(["--nnodes=2:4", "train.py"]).nnodes.max == 4  # the flag wins
    assert main.main(["master", "--job-dir=job"]) == 2
    assert capsys.readouterr().err.startswith(
        f'dlrover-hpc master: error: {files.user}:5: [master] nnodes = "3:1": --nnodes=3:1: '
    )
    files.user.write_text("[run]\nnode_unit = 2\n")
    with pytest.raises(SystemExit):
        run_args.parse(["train.py"])
    assert capsys.readouterr().err.startswith(
        f"dlrover-run: error: {files.user}:2: [run] node_unit = 2: --node-unit=2 is larger "
        "than --nnodes maximum 1"
    )
    monkeypatch.setenv("DLROVER_HPC_NNODES", "4:2")
    with pytest.raises(SystemExit):
        run_args.parse(["--node-unit=1", "train.py"])
    assert capsys.readouterr().err.endswith(" (from DLROVER_HPC_NNODES=4:2)\n")
    monkeypatch.setenv("DLROVER_HPC_MONITOR_INTERVAL", "often")  # a flag new to the environment
    with pytest.raises(SystemExit):
        run_args.parse(["train.py"])
    assert "invalid float value: 'often' (from DLROVER_HPC_MONITOR_INTERVAL=often)" in (
        capsys.readouterr().err
    )


def test_missing_and_unreadable_files(
    files: Files, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = files.work / "nope.toml"
    with pytest.raises(SystemExit) as exc:
        run_args.parse(["--config", str(missing), "train.py"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        f"dlrover-run: error: {missing}: no such configuration file (named by --config); fix: "
        "check the path, or drop --config\n"
    )
    monkeypatch.setenv("DLROVER_HPC_CONFIG", str(missing))
    assert main.main(["master"]) == 2
    assert capsys.readouterr().err == (
        f"dlrover-hpc master: error: {missing}: no such configuration file (named by "
        "DLROVER_HPC_CONFIG); fix: check the path, or drop DLROVER_HPC_CONFIG\n"
    )
    monkeypatch.delenv("DLROVER_HPC_CONFIG")
    files.site.unlink()  # named by DLROVER_HPC_SITE_CONFIG: it must exist
    assert main.main(["config", "show"]) == 2
    assert "(named by DLROVER_HPC_SITE_CONFIG)" in capsys.readouterr().err
    files.site.write_text("")
    # Unreadable: root reads every file whatever its mode, but not a directory.
    files.user.mkdir(parents=True, exist_ok=True)
    assert main.main(["config", "show"]) == 2
    assert capsys.readouterr().err == (
        f"dlrover-hpc config show: error: {files.user}: cannot read this user configuration "
        "file (Is a directory); fix: make it readable (chmod u+r), or remove it\n"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of any mode")
def test_a_file_without_read_permission(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    files.site.chmod(0)
    assert main.main(["config", "show"]) == 2
    assert "cannot read this site configuration file (Permission denied); fix: make it " in (
        capsys.readouterr().err
    )


# ------------------------------------------------------------------ config show and get
def test_config_show_prints_values_and_sources(
    files: Files, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    files.site.write_text('[master]\ndrain = "quarantine"\n\n[run]\njob_dir = "/scratch/$WHO"\n')
    files.user.write_text("[run]\nnetwork_check = true\n")
    monkeypatch.setenv("WHO", "alice")
    monkeypatch.setenv("DLROVER_HPC_LINK_TIMEOUT", "10")
    assert main.main(["config", "show"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:6] == [
        "files, lowest precedence first:",
        f"  site    {files.site} (DLROVER_HPC_SITE_CONFIG)",
        f"  user    {files.user}",
        "  config  none (--config FILE or $DLROVER_HPC_CONFIG)",
        "precedence: flag > env DLROVER_HPC_<FLAG> > config > user > site > default",
        "",
    ]
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in out[6:]}
    assert rows[("section", "key")] == ["value", "source"]
    assert rows[("run", "max_restarts")] == ["3", "default"]
    assert rows[("run", "network_check")] == ["true", f"{files.user}:2"]
    assert rows[("run", "job_dir")] == ["/scratch/alice", f"{files.site}:5"]
    assert rows[("run", "link_timeout")] == ["10", "env", "DLROVER_HPC_LINK_TIMEOUT"]
    assert rows[("run", "rdzv_id")] == ["(none)", "default"]
    assert rows[("master", "drain")] == ["quarantine", f"{files.site}:2"]
    # One variable sets the flag of both commands.
    assert rows[("master", "link_timeout")] == ["10", "env", "DLROVER_HPC_LINK_TIMEOUT"]
    assert main.main(["config", "show", "master"]) == 0
    assert {line.split()[0] for line in capsys.readouterr().out.splitlines()[7:]} == {"master"}


def test_config_show_as_a_user_runs_it(files: Files) -> None:
    files.config.write_text("[run]\nmax_restarts = 7\n")
    proc = subprocess.run(
        [str(BIN / "dlrover-hpc"), "config", "show", "--config", str(files.config), "run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=files.work,
        env=files.env(DLROVER_HPC_NODE_UNIT="2"),
    )
    assert proc.returncode == 0, proc.stderr
    assert f"  config  {files.config} (--config)" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()]
    assert ["run", "max_restarts", "7", f"{files.config}:2"] in rows
    assert ["run", "node_unit", "2", "env", "DLROVER_HPC_NODE_UNIT"] in rows
    files.config.write_text("[run]\nmax_restarts = 7\nmax_restarts = 8\n")
    one_line_error(
        run(
            "dlrover-hpc",
            "config",
            "show",
            "--config",
            str(files.config),
            cwd=files.work,
            env=files.env(),
        ),
        2,
        f"dlrover-hpc config show: error: {files.config}:3: not valid TOML: Cannot overwrite a "
        "value",
    )


def test_config_get(files: Files, capsys: pytest.CaptureFixture[str]) -> None:
    files.site.write_text('[run]\nmax_restarts = 5\n[master]\ndrain = "off"\n')
    files.config.write_text("[run]\nnnodes = '2:8'\n")
    assert main.main(["config", "get", "run.max_restarts", "master.drain", "run.config"]) == 0
    assert capsys.readouterr().out == "5\noff\n\n"
    argv = ["--config", "../job.toml", "--max_restarts", "9", "train.py", "--config", "x"]
    assert (
        main.main(["config", "get", "run.nnodes", "run.max_restarts", "run.config", "--", *argv])
        == 0
    )
    assert capsys.readouterr().out == f"2:8\n9\n{files.config}\n"
    assert main.main(["config", "get", "run.max_restart"]) == 2
    assert capsys.readouterr().err == (
        "dlrover-hpc config get: error: run.max_restart: dlrover-run has no such flag; fix: "
        "did you mean run.max_restarts?\n"
    )
    assert main.main(["config", "get", "max_restarts"]) == 2
    assert "expected SECTION.KEY" in capsys.readouterr().err


def test_train_sbatch_takes_the_agents_settings_from_the_config(files: Files) -> None:
    """The part of sbatch/train.sbatch that reads the configuration, run as the job runs it."""
    script = (REPO / "sbatch" / "train.sbatch").read_text().splitlines()
    start = next(i for i, line in enumerate(script) if line.startswith("settings=$("))
    end = next(i for i, line in enumerate(script) if line.startswith("export DLROVER_HPC_JOB_DIR"))
    part = "\n".join(["set -uo pipefail", *script[start : end + 1]])
    show = (
        'echo "$config|$DLROVER_HPC_JOB_DIR|$nnodes|$max_restarts|$node_unit|$replacement_sbatch'
        '|$requeue_by"'
    )
    files.config.write_text(
        '[run]\nnnodes = "2:4"\nnode_unit = 2\njob_dir = "/scratch/job-$SLURM_JOB_ID"\n'
        'requeue_by = "framework"\n'
        '[master]\nreplacement_sbatch = "/opt/replacement.sbatch"\nmax_restarts = 1\n'
    )
    env = files.env(PATH=f"{BIN}:{os.environ['PATH']}", SLURM_JOB_ID="42")

    def job(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", f"{part}\n{show}", "train.sbatch", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=files.work,
            env=env,
        )

    out = job("--config", "../job.toml", "--max-restarts=6", "train.py", "--nnodes", "9")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (
        f"{files.config}|/scratch/job-42|2:4|6|2|/opt/replacement.sbatch|framework\n"
    )
    files.config.write_text("[run]\nmax_restarts = -\n")
    out = job("--config", "../job.toml", "train.py")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("dlrover-run: error: ../job.toml:2: not valid TOML: ")


def test_the_example_site_file_is_valid(files: Files, monkeypatch: pytest.MonkeyPatch) -> None:
    example = REPO / "examples" / "site-config.toml"
    monkeypatch.setenv("DLROVER_HPC_SITE_CONFIG", str(example))
    loaded = load(None, run_args.section_parsers())
    site = loaded.files[0]
    assert site.found and site.path == str(example)
    lines = example.read_text().splitlines()
    settings = [line for line in lines if line and line[0].isalpha()]
    assert len(site.entries) == len(settings) >= 10
    for entry in site.entries:  # each at its own line
        assert lines[entry.line - 1].startswith(f"{entry.key} = "), entry


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a = 1\n[run]\nx = 1\n", {("a",): 1, ("run",): 2, ("run", "x"): 3}),
        (
            "# c\n  [ run ]  # c\n\n 'x' = 1\n\"y\"=2\n",
            {("run",): 2, ("run", "x"): 4, ("run", "y"): 5},
        ),
        ('run.x = 1\nrun . "y z" = 2\n', {("run",): 1, ("run", "x"): 1, ("run", "y z"): 2}),
        (
            "[run]\ns = \"\"\"\nx = 1\n\"\"\"\nt = '''a'''\nu = 2\n",
            {("run",): 1, ("run", "s"): 2, ("run", "t"): 5, ("run", "u"): 6},
        ),
        (
            "[run.sub]\nk = 1\n[[arr]]\n",
            {("run",): 1, ("run", "sub"): 1, ("run", "sub", "k"): 2, ("arr",): 3},
        ),
    ],
)
def test_locate(text: str, expected: dict[tuple[str, ...], int]) -> None:
    assert locate(text) == expected


def test_no_files_at_all(files: Files, monkeypatch: pytest.MonkeyPatch) -> None:
    """No site file (DLROVER_HPC_SITE_CONFIG empty), no user file, no --config: defaults."""
    monkeypatch.setenv("DLROVER_HPC_SITE_CONFIG", "")
    loaded = load(None, run_args.section_parsers())
    assert [(f.layer.value, f.found, f.entries) for f in loaded.files] == [("user", False, ())]
    assert loaded.config_path() is None
    assert run_args.parse_args(["train.py"]).origins["max_restarts"].describe() == "default"
