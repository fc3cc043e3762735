"""`dlrover-hpc topology ...` verbs through `register()`, with a fake scontrol for from-slurm."""

from __future__ import annotations

import argparse
import os
import re
import stat
from pathlib import Path

import pytest

from dlrover_hpc.cli.topology import register
from dlrover_hpc.errors import TopologyError, UsageError
from dlrover_hpc.topology import load

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
FAT_TREE = REPO / "topology" / "fat-tree.conf"
LOCAL = REPO / "topology" / "local-slurm.conf"
SWITCH_LIST = REPO / "topology" / "switch-list.txt"
VERBS = [
    "show",
    "validate",
    "order",
    "convert",
    "add-node",
    "move-node",
    "remove-node",
    "add-switch",
    "remove-switch",
    "from-slurm",
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlrover-hpc")
    register(p.add_subparsers(dest="command"))
    return p


def run(*argv: str | Path) -> int:
    args = parser().parse_args(["topology", *map(str, argv)])
    code = args.func(args)
    assert isinstance(code, int)
    return code


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["topology", verb, "--help"])
    assert info.value.code == 0
    assert "usage: dlrover-hpc topology " + verb in capsys.readouterr().out


def test_verb_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["topology"])
    assert info.value.code == 2


def test_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("show", LOCAL) == 0
    assert capsys.readouterr().out == (
        f"{LOCAL}: 3 switches, 4 nodes, 2 levels (slurm)\n"
        "spine1\n"
        "|-- leaf1 (2 nodes): node[1-2]\n"
        "`-- leaf2 (2 nodes): node[3-4]\n"
    )


def test_show_marks_a_second_parent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.conf"
    path.write_text("SwitchName=l0 Nodes=a\nSwitchName=s0 Switches=l0\nSwitchName=s1 Switches=l0\n")
    assert run("show", path) == 0
    assert capsys.readouterr().out.splitlines()[1:] == [
        "s0",
        "`-- l0 (1 node): a",
        "s1",
        "`-- l0 (see s0)",
    ]


def test_validate_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("validate", SWITCH_LIST) == 0
    assert capsys.readouterr().out == f"{SWITCH_LIST}: ok (switch-list, 6 switches, 8 nodes)\n"


def test_validate_bad_file_exits_2_with_file_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.conf"
    path.write_text("SwitchName=l0 Nodes=n[1-2]\nSwitchName=l1 Nodes=n2 Foo=1\n")
    assert run("validate", path) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].startswith(f"{path}:2: unknown key 'Foo'")
    assert err[1].startswith(f"{path}:2: node 'n2' is under two leaf switches")


def test_order_all_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("order", SWITCH_LIST) == 0
    assert capsys.readouterr().out.split() == [
        "192.168.0.1",
        "192.168.0.2",
        "192.168.0.3",
        "192.168.0.4",
        "192.168.1.1",
        "192.168.1.2",
        "192.168.1.3",
        "192.168.1.4",
    ]


def test_order_warns_about_missing_nodes(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("order", LOCAL, "--nodes", "node[4,3,1],node10,gpu-a[001-002]") == 0
    captured = capsys.readouterr()
    assert captured.out == "node1\nnode3\nnode4\ngpu-a001\ngpu-a002\nnode10\n"
    warnings = captured.err.splitlines()
    assert len(warnings) == 3
    assert warnings[0] == (
        f"dlrover-hpc: warning: node 'gpu-a001' is not in {LOCAL}; it goes last (add it with:"
        f" dlrover-hpc topology add-node {LOCAL} gpu-a001 --switch LEAF)"
    )
    assert "'node10'" in warnings[2]


def test_order_bad_hostlist_is_usage_error() -> None:
    with pytest.raises(UsageError, match="--nodes: 'node\\[1-' is not a valid hostlist"):
        run("order", LOCAL, "--nodes", "node[1-")


def test_order_bad_file_raises_topology_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.conf"
    path.write_text("SwitchName=l0 Nodes=n[1-\n")
    with pytest.raises(TopologyError, match="^" + re.escape(f"{path}:1: malformed hostlist")):
        run("order", path)


def test_convert_round_trip_through_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    as_list = tmp_path / "list.txt"
    as_conf = tmp_path / "back.conf"
    assert run("convert", FAT_TREE, "--to", "switch-list", "--output", as_list) == 0
    assert run("convert", as_list, "--to", "slurm", "-o", as_conf) == 0
    assert load(as_conf).shape() == load(FAT_TREE).shape()
    assert run("convert", SWITCH_LIST, "--to", "slurm") == 0
    out = capsys.readouterr().out
    assert "SwitchName=asw-0 Nodes=192.168.0.[1-2]\n" in out
    assert "SwitchName=psw-1 Switches=asw-[2-3]\n" in out


def test_convert_warns_about_what_a_switch_list_drops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "deep.conf"
    path.write_text(
        "SwitchName=l0 Nodes=a LinkSpeed=5\nSwitchName=s0 Switches=l0\nSwitchName=c Switches=s0\n"
    )
    assert run("convert", path, "--to", "switch-list") == 0
    captured = capsys.readouterr()
    assert "l0  s0  a\n" in captured.out
    assert "switch 'c' (level 2) is above the pod switches" in captured.err
    assert "LinkSpeed=5 of switch 'l0' is dropped" in captured.err


def test_edit_verbs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.conf"
    path.write_text(LOCAL.read_text())
    assert run("add-node", path, "node[5-6]", "--switch", "leaf2") == 0
    assert run("move-node", path, "node5", "--to", "leaf1") == 0
    assert run("remove-node", path, "node6") == 0
    assert run("add-switch", path, "leaf3", "--nodes", "node[7-8]", "--parent", "spine1") == 0
    assert run("add-switch", path, "core", "--switches", "spine1") == 0
    assert run("remove-switch", path, "leaf3") == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: added node[5-6] to leaf2",
        f"{path}: moved node5 to leaf1",
        f"{path}: removed node6",
        f"{path}: added switch leaf3 over node[7-8] under spine1",
        f"{path}: added switch core over spine1",
        f"{path}: removed switch leaf3 and nodes node[7-8]",
    ]
    topology = load(path)
    assert topology.leaf_of() == {
        "node1": "leaf1",
        "node2": "leaf1",
        "node5": "leaf1",
        "node3": "leaf2",
        "node4": "leaf2",
    }
    assert path.read_text().startswith("# Default topology of the local 4-node Slurm")


def test_add_switch_needs_nodes_or_switches(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["topology", "add-switch", str(tmp_path / "t.conf"), "x"])


FAKE_SCONTROL = """#!/bin/sh
if [ "$1 $2" != "show topology" ]; then echo "unexpected: $*" >&2; exit 3; fi
printf 'SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node1,node2\\n'
printf 'SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node3,node4\\n'
printf 'SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]\\n'
"""


def _fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "scontrol"
    exe.write_text(script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_from_slurm_writes_topology_conf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_scontrol(tmp_path, monkeypatch, FAKE_SCONTROL)
    out = tmp_path / "topology.conf"
    assert run("from-slurm", "--output", out) == 0
    assert out.read_text() == (
        "# Written by `dlrover-hpc topology from-slurm` from `scontrol show topology`.\n"
        "SwitchName=leaf1 Nodes=node[1-2]\n"
        "SwitchName=leaf2 Nodes=node[3-4]\n"
        "SwitchName=spine1 Switches=leaf[1-2]\n"
    )
    assert load(out).shape() == load(LOCAL).shape()
    assert run("from-slurm") == 0
    assert capsys.readouterr().out == out.read_text()


def test_from_slurm_failure_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_scontrol(tmp_path, monkeypatch, "#!/bin/sh\necho 'slurm_load_topo error' >&2\nexit 1\n")
    out = tmp_path / "topology.conf"
    assert run("from-slurm", "--output", out) == 1
    assert "exit code 1: slurm_load_topo error" in capsys.readouterr().err
    assert not out.exists()


def test_from_slurm_times_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_scontrol(tmp_path, monkeypatch, "#!/bin/sh\nexec sleep 30\n")
    assert run("from-slurm", "--timeout-s", "0.5") == 1
    assert "did not answer within 0.5 s" in capsys.readouterr().err


def test_from_slurm_without_scontrol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert run("from-slurm") == 1
    assert "cannot run 'scontrol': not found on PATH" in capsys.readouterr().err


def test_from_slurm_from_topology_addrs(tmp_path: Path) -> None:
    addrs = tmp_path / "addrs.txt"
    addrs.write_text(
        "".join(
            f"node{i} spine1.leaf{1 if i <= 2 else 2}.node{i} switch.switch.node\n"
            for i in (4, 2, 3, 1)
        )
    )
    out = tmp_path / "topology.conf"
    assert run("from-slurm", "--addrs", addrs, "--output", out) == 0
    assert load(out).shape() == load(LOCAL).shape()
