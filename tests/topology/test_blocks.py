"""Slurm's block topology: block.conf and the block plugin's `scontrol show topology` output.

The local Slurm is 22.05, which has no block plugin, so the `scontrol` samples below are
captured verbatim from newer Slurm installations as their documentation prints them; each
sample's comment says where it was copied from. The format they follow is Slurm's own
`_print_topo_record` (SchedMD/slurm src/plugins/topology/block/topology_block.c at commit
284c3b95f08a2dc2478499837b03355e1b9c5c75): "%s=%s BlockIndex=%u" with BlockName or
AggregatedBlock, then " Nodes=%s" where the block has nodes, then " BlockSize=%u".
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from dlrover_hpc.cli.topology import register
from dlrover_hpc.errors import TopologyError
from dlrover_hpc.topology import (
    TopologyFormat,
    detect_format,
    load,
    loads,
    order_nodes,
    parse_scontrol_topology,
    rank_order,
    render,
)
from dlrover_hpc.topology.edit import add_nodes, add_switch, edit_file, move_nodes, remove_nodes

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
MAN_PAGE_EXAMPLE = REPO / "topology" / "blocks.conf"
LOCAL_BLOCKS = REPO / "topology" / "local-blocks.conf"

# NVIDIA Technical Blog, "Achieving Peak System and Workload Efficiency on NVIDIA GB200 NVL72
# with Slurm Block Scheduling" (2026-05-07), https://developer.nvidia.com/blog/?p=116606 :
# "The block topology created by Slurm can be verified with the following command".
SCONTROL_NVIDIA_BLOG = (
    "BlockName=block01 BlockIndex=0 Nodes=node[0001-0018] BlockSize=18\n"
    "BlockName=block02 BlockIndex=1 Nodes=node[0019-0036] BlockSize=18\n"
)
# crusoecloud/slurm README.md, section "GB200 Support", step 6 "Verify the topology:
# `scontrol show topology`" (a GB200 NVL72 cluster of 10 racks; stored version id 38066900411
# of the code index).
SCONTROL_CRUSOE = (
    "BlockName=block01 BlockIndex=0 Nodes=slurm-compute-node-[000-017] BlockSize=18\n"
    "BlockName=block02 BlockIndex=1 Nodes=slurm-compute-node-[018-035] BlockSize=18\n"
    "BlockName=block03 BlockIndex=2 Nodes=slurm-compute-node-[036-053] BlockSize=18\n"
    "BlockName=block04 BlockIndex=3 Nodes=slurm-compute-node-[054-071] BlockSize=18\n"
    "BlockName=block05 BlockIndex=4 Nodes=slurm-compute-node-[072-089] BlockSize=18\n"
    "BlockName=block06 BlockIndex=5 Nodes=slurm-compute-node-[090-107] BlockSize=18\n"
    "BlockName=block07 BlockIndex=6 Nodes=slurm-compute-node-[108-125] BlockSize=18\n"
    "BlockName=block08 BlockIndex=7 Nodes=slurm-compute-node-[126-143] BlockSize=18\n"
    "BlockName=block09 BlockIndex=8 Nodes=slurm-compute-node-[144-161] BlockSize=18\n"
    "BlockName=block10 BlockIndex=9 Nodes=slurm-compute-node-[162-179] BlockSize=18\n"
)
# A public test log, "OKE GB300 Topology Block Test Log" (2026-05-06; Slinky's slurm-operator
# on OKE, block_sizes [2, 4] in topology.yaml), section "Topology Validation": two base blocks
# and Slurm's aggregated block over both. The code index that holds it did not name its
# repository.
SCONTROL_GB300_AGGREGATED = (
    "BlockName=gb300_b0 BlockIndex=0 Nodes=10.140.71.103,10.140.88.115 BlockSize=2\n"
    "BlockName=gb300_b1 BlockIndex=1 Nodes=10.140.79.152,10.140.93.120 BlockSize=2\n"
    "AggregatedBlock=gb300_b[0-1] BlockIndex=2"
    " Nodes=10.140.71.103,10.140.79.152,10.140.88.115,10.140.93.120 BlockSize=4\n"
)


def blocks(text_or_topology: str | object) -> dict[str, list[str]]:
    topology = loads(text_or_topology) if isinstance(text_or_topology, str) else text_or_topology
    return {b.name: list(b.nodes) for b in topology.switches}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "n_blocks", "n_nodes", "sizes"),
    [
        (SCONTROL_NVIDIA_BLOG, 2, 36, (18,)),
        (SCONTROL_CRUSOE, 10, 180, (18,)),
        (SCONTROL_GB300_AGGREGATED, 2, 4, (2, 4)),
    ],
    ids=["nvidia-blog", "crusoe", "gb300-aggregated"],
)
def test_captured_scontrol_block_output_parses(
    text: str, n_blocks: int, n_nodes: int, sizes: tuple[int, ...]
) -> None:
    assert detect_format(text) is TopologyFormat.SCONTROL_BLOCK
    topology = parse_scontrol_topology(text)  # what `from-slurm` and the master call
    assert topology.format is TopologyFormat.SCONTROL_BLOCK
    assert len(topology.switches) == n_blocks
    assert len(topology.leaf_of()) == n_nodes
    assert topology.block_sizes == sizes
    assert all(not b.switches for b in topology.switches)


def test_aggregated_block_adds_no_block_and_order_keeps_blocks_contiguous() -> None:
    topology = loads(SCONTROL_GB300_AGGREGATED)
    assert blocks(topology) == {
        "gb300_b0": ["10.140.71.103", "10.140.88.115"],
        "gb300_b1": ["10.140.79.152", "10.140.93.120"],
    }
    # The job's node list in the log, in Slurm's order: ranks 0-1 are gb300_b0's nodes.
    hosts = ["10.140.88.115", "10.140.71.103", "10.140.79.152", "10.140.93.120"]
    assert order_nodes(topology, hosts) == (
        ["10.140.71.103", "10.140.88.115", "10.140.79.152", "10.140.93.120"],
        [],
    )


def test_man_page_block_conf() -> None:
    topology = load(MAN_PAGE_EXAMPLE)
    assert topology.format is TopologyFormat.BLOCK
    assert topology.block_sizes == (30, 120)
    assert list(blocks(topology)) == ["block1", "block2", "block3", "block4"]
    assert rank_order(topology) == [f"node{i}" for i in range(1, 129)]


@pytest.mark.parametrize(
    ("text", "hosts", "expected"),
    [
        # blocks in natural order (b2 < b10), whatever the file order
        (
            "BlockName=b10 Nodes=n[1-2]\nBlockName=b2 Nodes=n[3-4]\n",
            ["n1", "n2", "n3", "n4"],
            ["n3", "n4", "n1", "n2"],
        ),
        # a block's nodes stay contiguous even where names interleave across blocks
        (
            "BlockName=b1 Nodes=n[1,3,5,7]\nBlockName=b2 Nodes=n[2,4,6,8]\n",
            ["n8", "n1", "n2", "n7"],
            ["n1", "n7", "n2", "n8"],
        ),
        # a node outside every block goes last; an empty (placeholder) block is fine
        (
            "BlockName=b1 Nodes=n[3-4]\nBlockName=b0\nBlockSizes=2\n",
            ["x9", "n4", "n3"],
            ["n3", "n4", "x9"],
        ),
    ],
)
def test_order_in_block_order(text: str, hosts: list[str], expected: list[str]) -> None:
    ordered, missing = order_nodes(loads(text), hosts)
    assert ordered == expected
    assert missing == [h for h in expected if h.startswith("x")]


def test_convert_scontrol_blocks_to_block_conf_and_back() -> None:
    topology = loads(SCONTROL_GB300_AGGREGATED)
    text = render(topology, TopologyFormat.BLOCK, header="from scontrol")
    assert text == (
        "# from scontrol\n"
        "BlockName=gb300_b0 Nodes=10.140.71.103,10.140.88.115\n"
        "BlockName=gb300_b1 Nodes=10.140.79.152,10.140.93.120\n"
        "BlockSizes=2,4\n"
    )
    again = loads(text)
    assert again.format is TopologyFormat.BLOCK
    assert again.shape() == topology.shape() and again.block_sizes == (2, 4)


def test_convert_blocks_to_tree_and_tree_to_blocks() -> None:
    tree = loads(render(load(LOCAL_BLOCKS), TopologyFormat.SLURM))
    assert tree.format is TopologyFormat.SLURM
    assert blocks(tree) == {"nvl1": ["node1"], "nvl2": ["node2", "node3", "node4"]}
    fat = load(REPO / "topology" / "fat-tree.conf")
    as_blocks = loads(render(fat, TopologyFormat.BLOCK))
    assert rank_order(as_blocks) == rank_order(fat)  # leaves become blocks, in the same order


def test_scontrol_block_output_with_switch_lines_is_refused() -> None:
    text = SCONTROL_NVIDIA_BLOG + "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n1\n"
    with pytest.raises(TopologyError, match=r"^scontrol show topology:3: a tree-plugin line"):
        parse_scontrol_topology(text)


def test_edit_block_file_keeps_comments_and_writes_block_lines(tmp_path: Path) -> None:
    path = tmp_path / "block.conf"
    path.write_text("# racks\nBlockName=r1 Nodes=n[1-3]  # rack 1\nBlockName=r2 Nodes=n4\n")
    edit_file(path, lambda t: add_nodes(t, ["n5"], switch="r2"))
    edit_file(path, lambda t: move_nodes(t, ["n3"], switch="r2"))
    edit_file(path, lambda t: add_switch(t, "r3", nodes=["n6"]))
    edit_file(path, lambda t: remove_nodes(t, ["n6"]))  # leaves an empty placeholder block
    assert path.read_text() == (
        "# racks\nBlockName=r1 Nodes=n[1-2]  # rack 1\nBlockName=r2 Nodes=n[3-5]\nBlockName=r3\n"
    )
    with pytest.raises(TopologyError, match="a block file has blocks only"):
        edit_file(path, lambda t: add_switch(t, "top", switches=["r1", "r2"]))


def test_scontrol_output_is_not_edited(tmp_path: Path) -> None:
    path = tmp_path / "saved.txt"
    path.write_text(SCONTROL_NVIDIA_BLOG)
    with pytest.raises(TopologyError, match=r"convert .* --to block --output FILE"):
        edit_file(path, lambda t: remove_nodes(t, ["node0001"]))


def _cli(*argv: str | Path) -> int:
    p = argparse.ArgumentParser(prog="dlrover-hpc")
    register(p.add_subparsers(dest="command"))
    args = p.parse_args(["topology", *map(str, argv)])
    code = args.func(args)
    assert isinstance(code, int)
    return code


def test_cli_validate_show_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "scontrol.txt"
    saved.write_text(SCONTROL_GB300_AGGREGATED)
    assert _cli("validate", saved) == 0
    assert capsys.readouterr().out == (
        f"{saved}: ok (scontrol-block, 2 blocks, 4 nodes, BlockSizes=2,4)\n"
    )
    assert _cli("show", LOCAL_BLOCKS) == 0
    assert capsys.readouterr().out == (
        f"{LOCAL_BLOCKS}: 2 blocks, 4 nodes, BlockSizes=2 (block)\n"
        "nvl1 (1 node, 1 short of BlockSizes 2): node1\n"
        "nvl2 (3 nodes): node[2-4]\n"
    )
    assert _cli("order", LOCAL_BLOCKS, "--nodes", "node[1-5]") == 0
    out = capsys.readouterr()
    assert out.out.split() == ["node1", "node2", "node3", "node4", "node5"]
    assert "node 'node5' is not in" in out.err and "--switch BLOCK" in out.err
    bad = tmp_path / "bad.conf"
    bad.write_text("BlockName=b1 Nodes=n1\nBlockSizes=3,5\n")
    assert _cli("validate", bad) == 2
    assert capsys.readouterr().err.startswith(f"{bad}:2: BlockSizes=3,5: 5 is not a power")


def test_from_slurm_under_the_block_plugin_writes_block_conf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "scontrol"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + SCONTROL_NVIDIA_BLOG + "EOF\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    out = tmp_path / "block.conf"
    assert _cli("from-slurm", "--output", out) == 0
    assert out.read_text() == (
        "# Written by `dlrover-hpc topology from-slurm` from `scontrol show topology`.\n"
        "BlockName=block01 Nodes=node[0001-0018]\n"
        "BlockName=block02 Nodes=node[0019-0036]\n"
        "BlockSizes=18\n"
    )
