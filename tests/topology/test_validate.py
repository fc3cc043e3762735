"""Every validation error: its kind, its line and its message, verbatim."""

from __future__ import annotations

import pytest

from dlrover_hpc.errors import TopologyError
from dlrover_hpc.topology import ProblemKind, TopologyProblems, loads, scan

pytestmark = pytest.mark.timeout(60)

K = ProblemKind
HOSTLIST_HINT = "write a Slurm hostlist like node[01-04,07],gpu-a[1-2]"
KEYS_HINT = "a topology.conf line takes SwitchName=, Nodes=, Switches= and LinkSpeed="

CASES = [
    # --- topology.conf syntax ---
    (
        "unknown-key",
        "SwitchName=s0 Nodes=n1 Colour=red\n",
        K.UNKNOWN_KEY,
        1,
        f"unknown key 'Colour'; {KEYS_HINT}",
    ),
    (
        "unknown-key-suggestion",
        "SwitchName=s0 Node=n1\n",
        K.UNKNOWN_KEY,
        1,
        f"unknown key 'Node'; did you mean 'Nodes='? {KEYS_HINT}",
    ),
    (
        "duplicate-key",
        "SwitchName=s0 Nodes=n1 nodes=n2\n",
        K.DUPLICATE_KEY,
        1,
        "'Nodes=' is given twice on this line; give it once (merge the hostlists with a comma)",
    ),
    (
        "block-line-in-tree-file",
        "SwitchName=s0 Nodes=n1\nBlockName=b0 Nodes=n2\n",
        K.MIXED_PLUGINS,
        2,
        "'BlockName=' is a block-plugin key in a tree topology.conf (its first line is"
        " SwitchName=); Slurm reads one plugin's lines: keep the BlockName= lines for"
        " TopologyPlugin=topology/block or the SwitchName= lines for topology/tree, one file each",
    ),
    (
        "include",
        "# site file\nInclude /etc/slurm/more.conf\n",
        K.UNSUPPORTED,
        2,
        "'Include' is not supported here; paste the included file's lines instead",
    ),
    (
        "missing-switch-name",
        "SwitchName=s0 Nodes=n1\nNodes=n2\n",
        K.MISSING_SWITCH_NAME,
        2,
        "no SwitchName= on this line; each line defines one switch: start it with SwitchName=NAME",
    ),
    (
        "switch-name-is-a-hostlist",
        "SwitchName=s[0-1] Nodes=n1\n",
        K.BAD_NAME,
        1,
        "switch name 's[0-1]' is not one name (it contains '[', ']'); SwitchName= takes one"
        " name: write one line per switch",
    ),
    (
        "bad-link-speed",
        "SwitchName=s0 Nodes=n1 LinkSpeed=fast\n",
        K.BAD_LINK_SPEED,
        1,
        "LinkSpeed=fast is not a whole number from 0 to 4294967295; write e.g. LinkSpeed=100 or"
        " drop it",
    ),
    (
        "malformed-hostlist-unbalanced",
        "SwitchName=s0 Nodes=gpu-a[001-003,010\n",
        K.BAD_HOSTLIST,
        1,
        f"malformed hostlist 'gpu-a[001-003,010' in Nodes= (unbalanced brackets); {HOSTLIST_HINT}",
    ),
    (
        "malformed-hostlist-range",
        "SwitchName=s0 Nodes=n[3-1]\n",
        K.BAD_HOSTLIST,
        1,
        f"malformed hostlist 'n[3-1]' in Nodes= (start > stop); {HOSTLIST_HINT}",
    ),
    (
        "malformed-hostlist-switches",
        "SwitchName=l1 Nodes=n1\nSwitchName=s0 Switches=l[1-\n",
        K.BAD_HOSTLIST,
        2,
        f"malformed hostlist 'l[1-' in Switches= (unbalanced brackets); {HOSTLIST_HINT}",
    ),
    (
        "blank-inside-hostlist",
        "SwitchName=s0 Nodes=n1, n2\n",
        K.BAD_SYNTAX,
        1,
        "'n2' is not KEY=VALUE; separate pairs with blanks and keep hostlists free of blanks"
        " (Nodes=node1,node2)",
    ),
    (
        "empty-value",
        "SwitchName=s0 Nodes=\n",
        K.BAD_SYNTAX,
        1,
        "'Nodes=' has no value; give one or drop the key",
    ),
    (
        "open-quote",
        'SwitchName=s0 Nodes="n1\n',
        K.BAD_SYNTAX,
        1,
        "cannot split the line (No closing quotation); close the quote",
    ),
    # --- tree structure ---
    (
        "duplicate-switch",
        "SwitchName=s0 Nodes=n1\nSwitchName=s0 Nodes=n2\n",
        K.DUPLICATE_SWITCH,
        2,
        "switch 's0' is already defined on line 1; a name defines one switch: rename one of"
        " them or merge the two lines",
    ),
    (
        "both-nodes-and-switches",
        "SwitchName=s0 Nodes=n1 Switches=s1\nSwitchName=s1 Nodes=n2\n",
        K.BOTH_CHILDREN,
        1,
        "switch 's0' has both Nodes= and Switches=; Slurm's tree plugin rejects that: put the"
        " nodes under a leaf switch of their own and list that leaf in Switches=",
    ),
    (
        "neither-nodes-nor-switches",
        "SwitchName=s0 LinkSpeed=1\n",
        K.NO_CHILDREN,
        1,
        "switch 's0' has neither Nodes= nor Switches=; add Nodes=HOSTLIST for a leaf switch or"
        " Switches=NAMES for an upper switch",
    ),
    (
        "undefined-child-switch",
        "SwitchName=leaf0 Nodes=n1\nSwitchName=spine0 Switches=leaf[0-1]\n",
        K.UNDEFINED_SWITCH,
        2,
        "switch 'leaf1' is used by 'spine0' but never defined; add 'SwitchName=leaf1 Nodes=...'"
        " or remove it from Switches=",
    ),
    (
        "node-under-two-leaves",
        "SwitchName=l0 Nodes=gpu-a[001-003,010]\nSwitchName=l1 Nodes=gpu-b7,gpu-a010\n",
        K.NODE_UNDER_TWO_LEAVES,
        2,
        "node 'gpu-a010' is under two leaf switches, 'l0' (line 1) and 'l1'; a node hangs off"
        " one leaf: remove it from one of them",
    ),
    (
        "switch-cycle",
        "SwitchName=l0 Nodes=n1\nSwitchName=a Switches=b,l0\nSwitchName=b Switches=c\n"
        "SwitchName=c Switches=a\n",
        K.CYCLE,
        4,
        "switch cycle a -> b -> c -> a (each switch lists the next in Switches=); a switch"
        " cannot be below itself: remove 'a' from Switches= of 'c'",
    ),
    (
        "switch-lists-itself",
        "SwitchName=l0 Nodes=n1\nSwitchName=a Switches=a,l0\n",
        K.CYCLE,
        2,
        "switch 'a' lists itself in Switches=; a switch cannot be below itself: remove 'a'"
        " from Switches= of 'a'",
    ),
    (
        "no-switches",
        "# nothing here\n",
        K.EMPTY,
        0,
        "no switches defined; add lines like 'SwitchName=leaf0 Nodes=node[1-4]' and"
        " 'SwitchName=spine0 Switches=leaf[0-1]'",
    ),
    # --- switch list ---
    (
        "switch-list-field-count",
        "asw-0 psw-0 node1\nasw-0 node2\n",
        K.BAD_SYNTAX,
        2,
        "expected 3 fields 'ASW PSW HOST' (access switch, pod switch, host), got 2; write one"
        " node per line, e.g. 'asw-0 psw-0 node1'",
    ),
    (
        "switch-list-hostlist",
        "asw-0 psw-0 node[1-2]\n",
        K.BAD_NAME,
        1,
        "host 'node[1-2]' is not one name (it contains '[', ']'); write one host per line",
    ),
    (
        "switch-list-duplicate-host",
        "a p h\na p h\n",
        K.DUPLICATE_NODE,
        2,
        "host 'h' is listed again (also on line 1); list each host once: delete one of the lines",
    ),
    (
        "switch-list-host-under-two-asws",
        "a p h\nb p h\n",
        K.NODE_UNDER_TWO_LEAVES,
        2,
        "host 'h' is under two access switches, 'a' (line 1) and 'b'; a host hangs off one"
        " access switch: delete one of the lines",
    ),
    (
        "switch-list-asw-under-two-psws",
        "a p h1\na q h2\n",
        K.SWITCH_UNDER_TWO_PODS,
        2,
        "access switch 'a' is under pod switch 'p' on line 1 but under 'q' here; an access"
        " switch has one pod switch: make the PSW column agree",
    ),
    (
        "switch-list-name-at-two-levels",
        "a p h1\nb a h2\n",
        K.SWITCH_AT_TWO_LEVELS,
        1,
        "'a' is an access switch here and a pod switch on line 2; a switch name is either an"
        " ASW or a PSW: rename one",
    ),
    (
        "switch-list-own-pod",
        "a a h1\n",
        K.SWITCH_AT_TWO_LEVELS,
        1,
        "'a' is both the access switch and the pod switch of this line; a switch name is"
        " either an ASW or a PSW: rename one",
    ),
    # --- block.conf (Slurm's block plugin) ---
    (
        "block-unknown-key",
        "BlockName=b1 Nodes=n[1-2] Node=n3\n",
        K.UNKNOWN_KEY,
        1,
        "unknown key 'Node'; did you mean 'Nodes='? a block line takes BlockName= and Nodes=,"
        " and one line takes BlockSizes=",
    ),
    (
        "block-sizes-not-doubling",
        "BlockName=b1 Nodes=n[1-2]\nBlockSizes=2,6\n",
        K.BAD_BLOCK_SIZES,
        2,
        "BlockSizes=2,6: 6 is not a power of two (2, 4, 8, ...) times 2; Slurm aggregates"
        " blocks in pairs: write e.g. BlockSizes=2,4",
    ),
    (
        "block-sizes-not-numbers",
        "BlockName=b1 Nodes=n[1-2]\nBlockSizes=0\n",
        K.BAD_BLOCK_SIZES,
        2,
        "BlockSizes=0 is not a list of whole numbers above 0; write e.g. BlockSizes=18 or"
        " BlockSizes=18,36,72",
    ),
    (
        "block-sizes-twice",
        "BlockSizes=2\nBlockName=b1 Nodes=n[1-2]\nBlockSizes=2\n",
        K.DUPLICATE_KEY,
        3,
        "BlockSizes= is already given on line 1; give it once",
    ),
    (
        "block-sizes-on-block-line",
        "BlockName=b1 Nodes=n[1-2] BlockSizes=2\n",
        K.BAD_SYNTAX,
        1,
        "BlockSizes= goes on a line of its own; move it off this BlockName= line",
    ),
    (
        "switch-line-in-block-file",
        "BlockName=b1 Nodes=n[1-2]\nSwitchName=s0 Nodes=n3\n",
        K.MIXED_PLUGINS,
        2,
        "'SwitchName=' is a tree-plugin key in a block topology; Slurm reads one plugin's lines:"
        " keep the BlockName= lines for TopologyPlugin=topology/block or the SwitchName= lines"
        " for topology/tree, one file each",
    ),
    (
        "block-without-name",
        "BlockName=b1 Nodes=n[1-2]\nNodes=n3\n",
        K.MISSING_SWITCH_NAME,
        2,
        "no BlockName= on this line; each line defines one block: start it with BlockName=NAME"
        " (or write BlockSizes=N,... alone on a line)",
    ),
    (
        "block-defined-twice",
        "BlockName=b1 Nodes=n[1-2]\nBlockName=b1 Nodes=n3\n",
        K.DUPLICATE_SWITCH,
        2,
        "block 'b1' is already defined on line 1; rename one of them or merge their Nodes= lists",
    ),
    (
        "node-in-two-blocks",
        "BlockName=b1 Nodes=n[1-2]\nBlockName=b2 Nodes=n[2-3]\n",
        K.NODE_UNDER_TWO_LEAVES,
        2,
        "node 'n2' is in block 'b1' (line 1) and in block 'b2'; a node belongs to one block:"
        " remove it from one of them",
    ),
    (
        "block-malformed-hostlist",
        "BlockName=b1 Nodes=n[1-\n",
        K.BAD_HOSTLIST,
        1,
        f"malformed hostlist 'n[1-' in Nodes= (unbalanced brackets); {HOSTLIST_HINT}",
    ),
    (
        "block-no-blocks",
        "# sizes only\nBlockSizes=4\n",
        K.EMPTY,
        0,
        "no blocks defined; add lines like 'BlockName=block1 Nodes=node[1-18]' and 'BlockSizes=18'",
    ),
    (
        "scontrol-block-size-not-a-number",
        "BlockName=b1 BlockIndex=0 Nodes=n[1-2] BlockSize=x\n",
        K.BAD_SYNTAX,
        1,
        "cannot read 'BlockName=b1 BlockIndex=0 Nodes=n[1-2] BlockSize=x': BlockSize='x' is not"
        " a number; expected block-plugin lines like 'BlockName=b1 BlockIndex=0"
        " Nodes=node[1-18] BlockSize=18'",
    ),
]


@pytest.mark.parametrize(
    ("text", "kind", "line", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in CASES],
)
def test_each_problem(text: str, kind: ProblemKind, line: int, message: str) -> None:
    _, problems = scan(text, source="t.conf")
    assert [(p.kind, p.line, p.message) for p in problems] == [(kind, line, message)]
    where = f"t.conf:{line}: " if line else "t.conf: "
    assert str(problems[0]) == where + message
    with pytest.raises(TopologyError) as info:
        loads(text, source="t.conf")
    assert str(info.value) == where + message


def test_every_problem_kind_is_covered() -> None:
    covered = {case[2] for case in CASES}
    assert covered == set(ProblemKind)


def test_all_problems_reported_in_line_order() -> None:
    text = (
        "SwitchName=l0 Nodes=n[1-2]\n"  # 1
        "SwitchName=l1 Nodes=n2 Colour=red\n"  # 2: two leaves + unknown key
        "SwitchName=sp Switches=l[0-2]\n"  # 3: l2 undefined
        "SwitchName=x Nodes=m[1-\n"  # 4: malformed, no extra "no children" problem
    )
    with pytest.raises(TopologyProblems) as info:
        loads(text, source="f.conf")
    got = [(p.line, p.kind) for p in info.value.problems]
    assert got == [
        (2, K.UNKNOWN_KEY),
        (2, K.NODE_UNDER_TWO_LEAVES),
        (3, K.UNDEFINED_SWITCH),
        (4, K.BAD_HOSTLIST),
    ]
    assert str(info.value).count("\n") == 3
    assert all(line.startswith("f.conf:") for line in str(info.value).splitlines())


def test_continued_line_reports_its_first_line() -> None:
    _, problems = scan("# c\nSwitchName=s0 \\\n  Nodes=n[1-\n", source="t.conf")
    assert [(p.kind, p.line) for p in problems] == [(K.BAD_HOSTLIST, 2)]
