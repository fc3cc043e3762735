"""Parsers: topology.conf, switch list, scontrol output, SLURM_TOPOLOGY_ADDR, format detection."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from dlrover_hpc.errors import TopologyError, UsageError
from dlrover_hpc.topology import (
    Switch,
    Topology,
    TopologyFormat,
    TopologyProblems,
    detect_format,
    load,
    loads,
    parse_addr_lines,
    parse_scontrol_topology,
    parse_slurm_conf,
    parse_switch_list,
    parse_topology_addr,
    read_topology_addr,
    topology_from_addrs,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def leaves(topology: Topology) -> dict[str, list[str]]:
    return {sw.name: list(sw.nodes) for sw in topology.switches if sw.nodes}


def uppers(topology: Topology) -> dict[str, list[str]]:
    return {sw.name: list(sw.switches) for sw in topology.switches if sw.switches}


@pytest.mark.parametrize(
    ("text", "expected_leaves", "expected_uppers"),
    [
        pytest.param(
            "SwitchName=s0 Nodes=gpu-a[001-003,010],gpu-b7",
            {"s0": ["gpu-a001", "gpu-a002", "gpu-a003", "gpu-a010", "gpu-b7"]},
            {},
            id="awkward-hostlist",
        ),
        pytest.param(
            "SwitchName=s0 Nodes=node[01-04,07],gpu-a[1-2]",
            {"s0": ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]},
            {},
            id="design-example",
        ),
        pytest.param(
            "SwitchName=s0 Nodes=rack[1-2]-n[1-2]",
            {"s0": ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]},
            {},
            id="two-ranges",
        ),
        pytest.param(
            "SwitchName=s0 Nodes=n[1-2]-ib",
            {"s0": ["n1-ib", "n2-ib"]},
            {},
            id="suffix-after-range",
        ),
        pytest.param(
            "switchname=s0 NODES=n1\nSWITCHNAME=top switches=s0",
            {"s0": ["n1"]},
            {"top": ["s0"]},
            id="keys-any-case",
        ),
        pytest.param(
            "  SwitchName=s0\tNodes=n1   LinkSpeed=100   # rack A\n\n# comment only\n",
            {"s0": ["n1"]},
            {},
            id="blanks-tabs-comments",
        ),
        pytest.param(
            'SwitchName="s0" Nodes="n[1-2]"',
            {"s0": ["n1", "n2"]},
            {},
            id="quoted-values",
        ),
        pytest.param(
            "SwitchName=s0 \\\n  Nodes=n[1-3] # continued\n",
            {"s0": ["n1", "n2", "n3"]},
            {},
            id="continuation-line",
        ),
        pytest.param(
            "SwitchName=s0 Nodes=10.0.0.[1-2]\nSwitchName=s1 Nodes=10.0.0.10",
            {"s0": ["10.0.0.1", "10.0.0.2"], "s1": ["10.0.0.10"]},
            {},
            id="ip-addresses",
        ),
        pytest.param(
            "SwitchName=l0 Nodes=a\nSwitchName=l1 Nodes=b\nSwitchName=sp Switches=l[0-1]\n"
            "SwitchName=core Switches=sp",
            {"l0": ["a"], "l1": ["b"]},
            {"sp": ["l0", "l1"], "core": ["sp"]},
            id="three-levels-switch-hostlist",
        ),
        pytest.param(
            "SwitchName=s0 Nodes=n[1-2],n2,n1",
            {"s0": ["n1", "n2"]},
            {},
            id="duplicates-in-one-hostlist-folded",
        ),
    ],
)
def test_slurm_conf_parses(
    text: str, expected_leaves: dict[str, list[str]], expected_uppers: dict[str, list[str]]
) -> None:
    topology = parse_slurm_conf(text, source="t.conf")
    assert leaves(topology) == expected_leaves
    assert uppers(topology) == expected_uppers
    assert topology.format is TopologyFormat.SLURM


def test_slurm_conf_keeps_link_speed_and_lines() -> None:
    topology = parse_slurm_conf(
        "# header\nSwitchName=s0 Nodes=n1 LinkSpeed=25\n\nSwitchName=s1 Switches=s0\n",
        source="t.conf",
    )
    assert topology.switches == (
        Switch(name="s0", nodes=("n1",), link_speed=25, line=2),
        Switch(name="s1", switches=("s0",), line=4),
    )


def test_escaped_hash_is_not_a_comment() -> None:
    topology = parse_slurm_conf("SwitchName=s0 Nodes=n1 # a \\# b", source="t.conf")
    assert leaves(topology) == {"s0": ["n1"]}


@pytest.mark.parametrize(
    ("text", "expected_leaves", "expected_uppers"),
    [
        pytest.param(
            "asw-0 psw-0 node1\nasw-0 psw-0 node2\nasw-1 psw-0 node3\n",
            {"asw-0": ["node1", "node2"], "asw-1": ["node3"]},
            {"psw-0": ["asw-0", "asw-1"]},
            id="plain",
        ),
        pytest.param(
            "# ASW PSW HOST\n\tasw0\t psw0   10.1.2.3   # gpu box\n\n",
            {"asw0": ["10.1.2.3"]},
            {"psw0": ["asw0"]},
            id="tabs-comments-ip",
        ),
        pytest.param(
            "a1 p1 h1\na2 p2 h2\na1 p1 h3\n",
            {"a1": ["h1", "h3"], "a2": ["h2"]},
            {"p1": ["a1"], "p2": ["a2"]},
            id="interleaved",
        ),
    ],
)
def test_switch_list_parses(
    text: str, expected_leaves: dict[str, list[str]], expected_uppers: dict[str, list[str]]
) -> None:
    topology = parse_switch_list(text, source="s.txt")
    assert leaves(topology) == expected_leaves
    assert uppers(topology) == expected_uppers
    assert topology.format is TopologyFormat.SWITCH_LIST


# Captured verbatim from the local 4-node Slurm 22.05 with topology/local-slurm.conf.
SCONTROL_LOCAL = (
    "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node1,node2\n"
    "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node3,node4\n"
    "SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2]\n"
)
# Older releases print a trailing blank after each field.
SCONTROL_TRAILING_BLANKS = (
    "SwitchName=leaf1 Level=0 LinkSpeed=1 Nodes=node[1-2] \n"
    "SwitchName=leaf2 Level=0 LinkSpeed=1 Nodes=node[3-4] \n"
    "SwitchName=spine1 Level=1 LinkSpeed=1 Nodes=node[1-4] Switches=leaf[1-2] \n"
)


@pytest.mark.parametrize("text", [SCONTROL_LOCAL, SCONTROL_TRAILING_BLANKS])
def test_scontrol_output_parses_and_drops_upper_nodes(text: str) -> None:
    topology = parse_scontrol_topology(text)
    assert leaves(topology) == {"leaf1": ["node1", "node2"], "leaf2": ["node3", "node4"]}
    assert uppers(topology) == {"spine1": ["leaf1", "leaf2"]}
    assert all(sw.link_speed is None for sw in topology.switches)  # 1 is Slurm's default
    assert topology.shape() == load(REPO / "topology" / "local-slurm.conf").shape()


def test_scontrol_keeps_non_default_link_speed_and_ignores_new_fields() -> None:
    text = "SwitchName=s0 Level=0 LinkSpeed=100 Nodes=n[1-2] Switches=(null) Extra=x\n"
    topology = parse_scontrol_topology(text)
    assert topology.switches[0].link_speed == 100
    assert leaves(topology) == {"s0": ["n1", "n2"]}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "printed no switches"),
        (
            "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n1\nBlockName=b1 BlockIndex=0 Nodes=n2"
            " BlockSize=1\n",
            "a block-plugin line",
        ),
        ("something unexpected\n", "is not KEY=VALUE"),
        ("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-\n", "malformed hostlist"),
        ("SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n" + "x" * 504 + "\n", "may have cut its Nodes="),
        ("SwitchName=s1 Level=1 LinkSpeed=1 Switches=s9 \n", "never defined"),
    ],
)
def test_scontrol_errors(text: str, needle: str) -> None:
    with pytest.raises(TopologyError, match=needle):
        parse_scontrol_topology(text)


def test_scontrol_error_names_line() -> None:
    with pytest.raises(TopologyError) as info:
        parse_scontrol_topology("SwitchName=a Level=0 LinkSpeed=1 Nodes=n1 \ngarbage\n")
    assert str(info.value).startswith("scontrol show topology:2: ")


@pytest.mark.parametrize(
    ("addr", "pattern", "switches", "node"),
    [
        ("spine1.leaf1.node1", "switch.switch.node", ("spine1", "leaf1"), "node1"),
        ("spine1.leaf1.node1", None, ("spine1", "leaf1"), "node1"),
        ("leaf1.node1.cluster.org", "switch.node", ("leaf1",), "node1.cluster.org"),
        ("node7", "node", (), "node7"),
    ],
)
def test_parse_topology_addr(
    addr: str, pattern: str | None, switches: tuple[str, ...], node: str
) -> None:
    parsed = parse_topology_addr(addr, pattern)
    assert parsed.switches == switches
    assert parsed.node == node


def test_read_topology_addr_from_environ() -> None:
    assert read_topology_addr({}) is None
    env = {"SLURM_TOPOLOGY_ADDR": "s1.s0.n3", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
    addr = read_topology_addr(env)
    assert addr is not None
    assert addr.switches == ("s1", "s0")


def test_topology_from_addrs_matches_topology_conf() -> None:
    addrs = {f"node{i}": f"spine1.leaf{1 if i <= 2 else 2}.node{i}" for i in range(1, 5)}
    topology = topology_from_addrs(addrs)
    assert topology.shape() == load(REPO / "topology" / "local-slurm.conf").shape()


def test_topology_from_addrs_skips_unswitched_and_rejects_conflicts() -> None:
    topology = topology_from_addrs({"a": "s.l.a", "b": "b"})
    assert topology.nodes() == ["a"]
    with pytest.raises(TopologyError, match="do not form one tree"):
        topology_from_addrs({"a": "s.l.a", "b": "l.s.b"})  # l under s and s under l
    with pytest.raises(TopologyError, match="empty field"):
        topology_from_addrs({"a": "s..a"})


@pytest.mark.parametrize(
    ("text", "fmt"),
    [
        ("# only a comment\nSwitchName=s Nodes=n\n", TopologyFormat.SLURM),
        ("a p h\n", TopologyFormat.SWITCH_LIST),
        ("SwitchName=s Level=0 LinkSpeed=1 Nodes=n \n", TopologyFormat.SCONTROL),
        ("", TopologyFormat.SLURM),
    ],
)
def test_detect_format(text: str, fmt: TopologyFormat) -> None:
    assert detect_format(text) is fmt


def test_loads_scontrol_output_saved_to_a_file(tmp_path: Path) -> None:
    path = tmp_path / "topo.txt"
    path.write_text(SCONTROL_LOCAL)
    assert load(path).format is TopologyFormat.SCONTROL


@pytest.mark.parametrize("name", ["fat-tree.conf", "local-slurm.conf", "switch-list.txt"])
def test_examples_load(name: str) -> None:
    topology = load(REPO / "topology" / name)
    assert topology.nodes()


def test_fat_tree_example_shape() -> None:
    topology = load(REPO / "topology" / "fat-tree.conf")
    assert {name: len(nodes) for name, nodes in leaves(topology).items()} == {
        f"leaf{i}": 4 for i in range(4)
    }
    assert uppers(topology) == {"spine0": ["leaf0", "leaf1", "leaf2", "leaf3"]}


def test_load_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such topology file"):
        load(tmp_path / "nope.conf")


def test_load_errors_are_topology_problems() -> None:
    with pytest.raises(TopologyProblems) as info:
        loads("SwitchName=s0 Nodes=n[1-\n", source="x.conf")
    assert info.value.problems[0].line == 1
    assert str(info.value).startswith("x.conf:1: malformed hostlist 'n[1-'")


def test_parse_addr_lines() -> None:
    text = (
        "# collected with srun\n"
        "node1 spine1.leaf1.node1 switch.switch.node\n"
        "node2 spine1.leaf1.node2\n"
        "spine1.leaf2.node3\n"
    )
    addrs = parse_addr_lines(text, source="addrs.txt")
    assert {h: a.switches for h, a in addrs.items()} == {
        "node1": ("spine1", "leaf1"),
        "node2": ("spine1", "leaf1"),
        "node3": ("spine1", "leaf2"),
    }
    with pytest.raises(TopologyError, match=r"^addrs\.txt:2: .*empty field"):
        parse_addr_lines("node1 s.l.node1\nnode2 s..node2\n", source="addrs.txt")
    with pytest.raises(TopologyError, match=r"^addrs\.txt:1: expected 'HOST SLURM_TOPOLOGY_ADDR"):
        parse_addr_lines("a b c d\n", source="addrs.txt")


def test_topology_problems_pickle() -> None:
    with pytest.raises(TopologyProblems) as info:
        loads("SwitchName=s0 Nodes=n[1-\n", source="x.conf")
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, TopologyProblems)
    assert again.problems == info.value.problems
    assert str(again) == str(info.value)
