"""Topology parsers against golden files (tests/plan/data/topo/).

Regenerate the golden JSON after an intended change:
    HPCTRAIN_REGEN=1 python3 -m pytest tests/plan/test_topology.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpctrain.plan.placement import local_gpu_order, rank_order, switches_request
from hpctrain.plan.topology import TopologyParseError, parse_nvidia_smi_topo, parse_slurm_topology

DATA = Path(__file__).parent / "data" / "topo"
MATRICES = ["dgx-a100", "dgx-h100", "pcie-l40s", "pcie-nvlink-pairs", "dgx1-v100"]
TREES = ["tree", "block"]
EXPECTED_ISLANDS = {
    "dgx-a100": [[0, 1, 2, 3, 4, 5, 6, 7]],
    "dgx-h100": [[0, 1, 2, 3, 4, 5, 6, 7]],
    "pcie-l40s": [[g] for g in range(8)],
    "pcie-nvlink-pairs": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dgx1-v100": [[0, 1, 2, 3], [4, 5, 6, 7]],
}


def _golden(name: str, produced: dict) -> dict:
    path = DATA / f"{name}.json"
    if os.environ.get("HPCTRAIN_REGEN"):
        path.write_text(json.dumps(produced, indent=2, sort_keys=True) + "\n")
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", MATRICES)
def test_nvidia_smi_golden(name):
    produced = parse_nvidia_smi_topo((DATA / f"{name}.txt").read_text()).to_json()
    assert produced == _golden(name, produced)
    assert produced["islands"] == EXPECTED_ISLANDS[name]


def test_nic_legend_names_the_nics():
    topo = parse_nvidia_smi_topo((DATA / "dgx-h100.txt").read_text())
    assert topo.nics[:2] == ("mlx5_0", "mlx5_1")


@pytest.mark.parametrize("name", TREES)
def test_slurm_topology_golden(name):
    produced = parse_slurm_topology((DATA / f"{name}.conf").read_text()).to_json()
    assert produced == _golden(name, produced)


def test_tree_leaves_and_parents():
    tree = parse_slurm_topology((DATA / "tree.conf").read_text())
    assert len(tree.leaves["leaf1"]) == 32 and tree.leaves["leaf3"][-1] == "bigmem4"
    assert tree.parents == {"leaf1": "spine1", "leaf2": "spine1", "leaf3": "spine1"}
    assert tree.max_leaf_nodes == 32


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "no header row"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNVX\nGPU1\tNVX\t X \n", "unknown link"),
        ("\tGPU0\tGPU1\nGPU0\t X \n", "cells"),
    ],
)
def test_nvidia_smi_errors(text, message):
    with pytest.raises(TopologyParseError, match=message):
        parse_nvidia_smi_topo(text)


@pytest.mark.parametrize(
    "text, message",
    [
        ("SwitchName=s1\n", "neither Nodes= nor Switches="),
        ("Nodes=a[1-2]\n", "no SwitchName"),
        ("SwitchName=s1 Nodes=a[1-\n", "bad hostlist"),
        ("SwitchName=s1 Nodes\n", "KEY=VALUE"),
        ("SwitchName=top Switches=s[1-2]\n", "no leaf switch"),
    ],
)
def test_slurm_topology_errors(text, message):
    with pytest.raises(TopologyParseError, match=message):
        parse_slurm_topology(text)


def test_rank_order_identity_without_pp_and_dp_interleaving():
    assert rank_order(8, 1, 4, 8) is None
    assert rank_order(2, 1, 8, 8) is None


def test_rank_order_puts_pp_inside_dp():
    # runtime grid view(pp=2, dp=2, tp=2); slots walk tp, then pp, then dp.
    order = rank_order(2, 2, 2, 8)
    # slot 2 (second pipeline stage of dp replica 0) runs rank pp=1, dp=0, tp=0 = 4
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]
    assert sorted(order) == list(range(8))


def test_rank_order_keeps_tp_inside_nvlink_pairs():
    # Bridged pairs (0,2), (1,3), (4,6), (5,7): tp=2 groups must land on a pair, not on GPUs 0 and 1.
    topo = parse_nvidia_smi_topo((DATA / "pcie-nvlink-pairs.txt").read_text())
    local = local_gpu_order(8, topo)
    assert local == [0, 2, 1, 3, 4, 6, 5, 7]
    order = rank_order(2, 1, 4, 8, local)
    assert order is not None
    slot_of = {rank: slot for slot, rank in enumerate(order)}
    for tp_group in range(4):
        a, b = slot_of[2 * tp_group], slot_of[2 * tp_group + 1]
        assert any({a, b} == set(island) for island in topo.islands)


def test_switches_requested_only_when_one_leaf_fits():
    tree = parse_slurm_topology((DATA / "tree.conf").read_text())
    assert switches_request(32, tree) == 1
    assert switches_request(33, tree) is None
    assert switches_request(4, None) is None
