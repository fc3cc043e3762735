"""Convert round trips and the editing operations (comments kept, atomic, validated first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlrover_hpc.errors import TopologyError
from dlrover_hpc.topology import (
    TopologyFormat,
    load,
    loads,
    rank_order,
    render,
    render_slurm_conf,
    render_switch_list,
    write_atomic,
)
from dlrover_hpc.topology.edit import (
    add_nodes,
    add_switch,
    edit_file,
    move_nodes,
    remove_nodes,
    remove_switch,
)

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = [REPO / "topology" / name for name in ("fat-tree.conf", "local-slurm.conf")]
SWITCH_LIST = REPO / "topology" / "switch-list.txt"


@pytest.mark.parametrize("path", [*EXAMPLES, SWITCH_LIST], ids=lambda p: p.name)
def test_round_trip_slurm_and_switch_list(path: Path) -> None:
    original = load(path)
    as_list = loads(render_switch_list(original, header="x"), source="l.txt")
    assert as_list.format is TopologyFormat.SWITCH_LIST
    assert as_list.shape() == original.shape()
    as_conf = loads(render_slurm_conf(as_list, header="y"), source="c.conf")
    assert as_conf.format is TopologyFormat.SLURM
    assert as_conf.shape() == original.shape()
    assert rank_order(as_conf) == rank_order(original) == rank_order(as_list)
    # Writing is deterministic: a second round gives the same text.
    assert render_slurm_conf(as_conf) == render_slurm_conf(original)
    assert render_switch_list(as_conf) == render_switch_list(original)


def test_round_trip_keeps_awkward_hostlists_and_link_speed() -> None:
    text = (
        "SwitchName=l0 Nodes=gpu-a[001-003,010],gpu-b7 LinkSpeed=200\n"
        "SwitchName=l1 Nodes=10.0.0.[1-2],node[1,10]\n"
        "SwitchName=s0 Switches=l[0-1]\n"
    )
    original = loads(text, source="t.conf")
    again = loads(render_slurm_conf(original), source="t2.conf")
    assert again.shape() == original.shape()


def test_render_slurm_conf_leaves_first() -> None:
    topology = loads(
        "SwitchName=core Switches=s0\nSwitchName=s0 Switches=l1\nSwitchName=l1 Nodes=n[1-3]\n",
        source="t.conf",
    )
    assert render_slurm_conf(topology, header="hello") == (
        "# hello\nSwitchName=l1 Nodes=n[1-3]\nSwitchName=s0 Switches=l1\n"
        "SwitchName=core Switches=s0\n"
    )


def test_switch_list_needs_a_pod_switch() -> None:
    topology = loads("SwitchName=l0 Nodes=n1\n", source="t.conf")
    with pytest.raises(TopologyError, match=r"t\.conf:1: leaf switch 'l0' has no parent switch"):
        render(topology, TopologyFormat.SWITCH_LIST)


CONF = """\
# Site topology, rack A and B
SwitchName=leaf1 Nodes=node[1-2]   # rack A
SwitchName=leaf2 Nodes=node[3-4]   # rack B

# the spine
SwitchName=spine1 Switches=leaf[1-2]
"""


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    path = tmp_path / "topology.conf"
    path.write_text(CONF)
    return path


def test_add_node_keeps_comments_and_untouched_lines(conf: Path) -> None:
    result = edit_file(conf, lambda t: add_nodes(t, ["node5", "node10"], switch="leaf2"))
    assert result.summary == "added node[5,10] to leaf2"
    assert conf.read_text() == (
        "# Site topology, rack A and B\n"
        "SwitchName=leaf1 Nodes=node[1-2]   # rack A\n"
        "SwitchName=leaf2 Nodes=node[3-5,10]  # rack B\n"
        "\n"
        "# the spine\n"
        "SwitchName=spine1 Switches=leaf[1-2]\n"
    )


def test_move_node(conf: Path) -> None:
    edit_file(conf, lambda t: move_nodes(t, ["node2"], switch="leaf2"))
    topology = load(conf)
    assert topology.leaf_of()["node2"] == "leaf2"
    assert "# rack A" in conf.read_text()
    assert rank_order(topology) == ["node1", "node2", "node3", "node4"]


def test_remove_node(conf: Path) -> None:
    edit_file(conf, lambda t: remove_nodes(t, ["node4"]))
    assert load(conf).nodes() == ["node1", "node2", "node3"]


def test_add_and_remove_switch(conf: Path) -> None:
    result = edit_file(
        conf,
        lambda t: add_switch(t, "leaf3", nodes=["node5", "node6"], parent="spine1", link_speed=10),
    )
    assert result.summary == "added switch leaf3 over node[5-6] under spine1"
    text = conf.read_text()
    assert "SwitchName=spine1 Switches=leaf[1-3]\n" in text
    assert text.endswith("SwitchName=leaf3 Nodes=node[5-6] LinkSpeed=10\n")
    assert "# the spine" in text
    result = edit_file(conf, lambda t: remove_switch(t, "leaf3"))
    assert result.summary == "removed switch leaf3 and nodes node[5-6]"
    assert load(conf).shape() == loads(CONF, source="x").shape()


def test_remove_upper_switch_takes_its_subtree(conf: Path) -> None:
    text = CONF + "SwitchName=leaf9 Nodes=node9\nSwitchName=core Switches=spine1,leaf9\n"
    conf.write_text(text)
    result = edit_file(conf, lambda t: remove_switch(t, "spine1"))
    assert result.summary == "removed switches leaf[1-2],spine1 and nodes node[1-4]"
    topology = load(conf)
    assert topology.nodes() == ["node9"]
    assert "# Site topology, rack A and B" in conf.read_text()


def test_add_switch_creates_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "new.conf"
    edit_file(path, lambda t: add_switch(t, "leaf0", nodes=["n1"]), create=True)
    assert path.read_text() == "SwitchName=leaf0 Nodes=n1\n"


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (
            lambda t: add_nodes(t, ["node3"], switch="leaf1"),
            "{f}:3: node 'node3' is already under 'leaf2'; use move-node to move it",
        ),
        (
            lambda t: add_nodes(t, ["node9"], switch="leaf7"),
            "{f}: no switch 'leaf7'; pick a leaf switch (leaf1, leaf2) or create it with"
            " add-switch leaf7 --nodes HOSTLIST --parent SWITCH",
        ),
        (
            lambda t: add_nodes(t, ["node9"], switch="spine1"),
            "{f}:6: switch 'spine1' has child switches, and nodes go under a leaf switch; pick"
            " one of: leaf1, leaf2",
        ),
        (
            lambda t: move_nodes(t, ["node9"], switch="leaf1"),
            "{f}: node 'node9' is not in the file; add it with add-node",
        ),
        (
            lambda t: move_nodes(t, ["node3", "node4"], switch="leaf1"),
            "{f}:3: moving them would leave switch 'leaf2' with no nodes, and an empty switch is"
            " invalid; remove the switch (remove-switch leaf2) or give it another node first",
        ),
        (
            lambda t: remove_nodes(t, ["node1", "node2"]),
            "{f}:2: removing them would leave switch 'leaf1' with no nodes, and an empty switch"
            " is invalid; remove the switch (remove-switch leaf1) or give it another node first",
        ),
        (
            lambda t: add_switch(t, "leaf1", nodes=["n9"]),
            "{f}:2: switch 'leaf1' already exists; pick another name",
        ),
        (
            lambda t: add_switch(t, "leaf3", nodes=["n9"], parent="leaf1"),
            "{f}:2: leaf switch 'leaf1' to hold 'leaf3'; a parent must be a switch with child"
            " switches: spine1",
        ),
        (
            lambda t: add_switch(t, "core", switches=["spine9"]),
            "{f}: no switch 'spine9' to put under 'core'; existing switches: leaf1, leaf2, spine1",
        ),
        (
            lambda t: remove_switch(t, "leaf9"),
            "{f}: no switch 'leaf9'; existing switches: leaf1, leaf2, spine1",
        ),
    ],
)
def test_edit_errors_leave_the_file_alone(conf: Path, operation: object, message: str) -> None:
    before = conf.read_bytes()
    with pytest.raises(TopologyError) as info:
        edit_file(conf, operation)  # type: ignore[arg-type]
    assert str(info.value) == message.format(f=conf)
    assert conf.read_bytes() == before


def test_remove_switch_refuses_to_empty_its_parent(tmp_path: Path) -> None:
    path = tmp_path / "t.conf"
    path.write_text("SwitchName=l0 Nodes=n1\nSwitchName=s0 Switches=l0\n")
    with pytest.raises(TopologyError, match="remove 's0' instead"):
        edit_file(path, lambda t: remove_switch(t, "l0"))


def test_invalid_file_is_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "bad.conf"
    path.write_text("SwitchName=l0 Nodes=n1\nSwitchName=l1 Nodes=n1\n")
    with pytest.raises(TopologyError) as info:
        edit_file(path, lambda t: add_nodes(t, ["n2"], switch="l0"))
    assert str(info.value).splitlines()[1].startswith(f"{path}:2: node 'n1' is under two leaf")
    assert path.read_text() == "SwitchName=l0 Nodes=n1\nSwitchName=l1 Nodes=n1\n"


SWITCHES = """\
# ASW PSW HOST
asw-0  psw-0  10.0.0.1   # first box
asw-0  psw-0  10.0.0.2
asw-1  psw-1  10.0.1.1
"""


def test_switch_list_edits_keep_comments(tmp_path: Path) -> None:
    path = tmp_path / "switches.txt"
    path.write_text(SWITCHES)
    edit_file(path, lambda t: add_nodes(t, ["10.0.0.3"], switch="asw-0"))
    edit_file(path, lambda t: move_nodes(t, ["10.0.0.1"], switch="asw-1"))
    edit_file(path, lambda t: add_switch(t, "asw-2", nodes=["10.0.2.1"], parent="psw-1"))
    assert path.read_text() == (
        "# ASW PSW HOST\n"
        "asw-1  psw-1  10.0.0.1  # first box\n"
        "asw-0  psw-0  10.0.0.2\n"
        "asw-0  psw-0  10.0.0.3\n"
        "asw-1  psw-1  10.0.1.1\n"
        "asw-2  psw-1  10.0.2.1\n"
    )
    edit_file(path, lambda t: remove_switch(t, "psw-0"))
    assert load(path).nodes() == ["10.0.0.1", "10.0.1.1", "10.0.2.1"]


def test_switch_list_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    path = tmp_path / "switches.txt"
    path.write_text(SWITCHES)
    with pytest.raises(TopologyError, match="a switch list cannot hold this change"):
        edit_file(path, lambda t: add_switch(t, "core", switches=["psw-0", "psw-1"]))
    assert path.read_text() == SWITCHES


def test_write_atomic_keeps_mode_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "t.conf"
    path.write_text("old\n")
    path.chmod(0o640)
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert os.listdir(tmp_path) == ["t.conf"]


def test_write_atomic_failure_leaves_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.conf"
    path.write_text("old\n")

    def broken_replace(src: str, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, "new\n")
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["t.conf"]


def test_write_atomic_through_a_symlink_keeps_the_link(tmp_path: Path) -> None:
    real = tmp_path / "real.conf"
    real.write_text("old\n")
    link = tmp_path / "link.conf"
    link.symlink_to(real)
    write_atomic(link, "new\n")
    assert link.is_symlink()
    assert real.read_text() == "new\n"
