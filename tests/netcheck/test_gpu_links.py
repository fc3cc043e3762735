"""The GPU link check: the pure verdict on link figures (table-driven), the probe's JSON line,
and, where CUDA is there, a real measurement of this node's links (skipped without GPUs)."""

from __future__ import annotations

import json

import pytest
import torch

from dlrover_hpc.netcheck import gpu_links
from dlrover_hpc.netcheck.gpu_links import Link, describe_slow, links_from_rows, slow_links
from dlrover_hpc.netcheck.model import NetcheckError
from dlrover_hpc.netcheck.result import ProbeResult

pytestmark = pytest.mark.timeout(120)


def gg(pairs: dict[tuple[int, int], float]) -> list[Link]:
    return [Link(src=f"cuda:{i}", dst=f"cuda:{j}", gbps=v) for (i, j), v in pairs.items()]


FOUR_GPUS = {(i, j): 350.0 for i in range(4) for j in range(4) if i != j}


@pytest.mark.parametrize(
    ("links", "slow"),
    [
        (gg(FOUR_GPUS), []),
        # one NVLink fell back to PCIe: 24 GB/s against a 350 GB/s median
        (gg({**FOUR_GPUS, (2, 3): 24.0}), [("cuda:2", "cuda:3", 350.0)]),
        # both directions of one pair are slow: the median of twelve still stands
        (
            gg({**FOUR_GPUS, (0, 1): 20.0, (1, 0): 21.0}),
            [("cuda:0", "cuda:1", 350.0), ("cuda:1", "cuda:0", 350.0)],
        ),
        # 30 % of the median is not slow (contention, not a broken link)
        (gg({**FOUR_GPUS, (2, 3): 105.0}), []),
        # two GPUs: the slower direction is held against the faster one
        (gg({(0, 1): 300.0, (1, 0): 40.0}), [("cuda:1", "cuda:0", 300.0)]),
        # kinds are not mixed: PCIe host links at 25 GB/s are normal next to NVLink
        (
            [
                *gg(FOUR_GPUS),
                *(Link(src="host", dst=f"cuda:{i}", gbps=25.0) for i in range(4)),
                *(Link(src=f"cuda:{i}", dst="host", gbps=26.0) for i in range(4)),
            ],
            [],
        ),
        # a GPU behind a bad PCIe slot: its host link is slow against the other GPUs'
        (
            [Link(src="host", dst=f"cuda:{i}", gbps=25.0 if i else 3.0) for i in range(4)],
            [("host", "cuda:0", 25.0)],
        ),
        # one GPU: its two host links are different kinds, nothing to compare
        ([Link(src="host", dst="cuda:0", gbps=5.0), Link(src="cuda:0", dst="host", gbps=50.0)], []),
        ([], []),
    ],
)
def test_slow_links(links: list[Link], slow: list[tuple[str, str, float]]) -> None:
    assert [(link.src, link.dst, normal) for link, normal in slow_links(links)] == slow


def test_describe_slow_names_the_link_and_the_fix() -> None:
    slow = slow_links(gg({**FOUR_GPUS, (2, 3): 24.0}))
    assert describe_slow(slow) == (
        "cuda:2->cuda:3 at 24.0 GB/s is under 25% of the median gpu-gpu link (350.0 GB/s);"
        " check the GPU links (nvidia-smi topo -m, nvidia-smi nvlink -s)"
    )


def test_probe_result_carries_the_links_through_its_json_line() -> None:
    rows = (("host", "cuda:0", 24.5), ("cuda:0", "host", 25.25))
    result = ProbeResult(ok=True, matmul_s=0.1, collective_s=0.2, device="cuda", gpu_links=rows)
    again = ProbeResult.from_json(result.to_json())
    assert again == result
    assert [link.gbps for link in links_from_rows(again.gpu_links)] == [24.5, 25.25]
    assert ProbeResult.from_json('{"ok": true}').gpu_links == ()
    with pytest.raises(NetcheckError, match="gpu_links is not"):
        ProbeResult.from_json('{"ok": true, "gpu_links": [["host", 1]]}')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path needs a machine without CUDA")
def test_without_gpus_the_check_is_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_links.measure_links(torch) == ()
    assert gpu_links.main([]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["skipped"] == "no CUDA device: no GPU links to check"
    assert line["gpus"] == 0 and line["links"] == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_measure_this_nodes_links(capsys: pytest.CaptureFixture[str]) -> None:
    count = torch.cuda.device_count()
    links = gpu_links.measure_links(torch, payload_bytes=64 << 20)
    assert len(links) == 2 * count + count * (count - 1)
    assert {(link.src, link.dst) for link in links} == {
        *((s, d) for i in range(count) for s, d in (("host", f"cuda:{i}"), (f"cuda:{i}", "host"))),
        *((f"cuda:{i}", f"cuda:{j}") for i in range(count) for j in range(count) if i != j),
    }
    # Faster than a 1 GB/s floor no PCIe 3 x16 link, let alone NVLink, falls under.
    assert all(link.gbps > 1.0 for link in links), links
    assert gpu_links.main(["--payload-mib", "256"]) == 0  # a healthy node has no slow link
    line = json.loads(capsys.readouterr().out)
    assert line["gpus"] == count and line["slow"] == []
    print(json.dumps(line))  # the figures, for the record (pytest -s)
