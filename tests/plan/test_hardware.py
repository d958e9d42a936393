"""Hardware catalog resolution: profiles, gpu_spec overrides, topology-given islands."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan.hardware import FABRICS, GPUS, NODES, resolve_hardware


def job(**cluster):
    return job_from_dict({"name": "t", "model": {"preset": "tiny"}, "cluster": cluster})


def test_catalog_covers_the_issue_list():
    assert {"v100-32gb", "a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l40s"} <= set(GPUS)
    assert {"dgx-a100", "dgx-h100", "hgx-h200", "pcie-l40s"} <= set(NODES)
    assert {"ib-hdr200", "ib-ndr400", "roce", "ethernet"} <= set(FABRICS)
    assert all(NODES[n].gpu in GPUS and NODES[n].fabric in FABRICS for n in NODES)


def test_node_profile_sets_islands_and_nics():
    hw = resolve_hardware(job(node="pcie-l40s", gpu="l40s", fabric="roce"))
    assert hw.nvlink_island_gpus == 1 and hw.nics_per_node == 2
    assert hw.node_fabric_bytes_per_s == pytest.approx(2 * 25e9 * 0.8)


def test_without_profile_nvlink_gpus_share_one_island_per_node():
    assert resolve_hardware(job(gpu="h100-80gb", gpus_per_node=4)).nvlink_island_gpus == 4
    assert resolve_hardware(job(gpu="l40s", gpus_per_node=4)).nvlink_island_gpus == 1
    assert resolve_hardware(job(gpu="h100-80gb", fabric="ethernet")).nics_per_node == 1


def test_topology_island_overrides_profile():
    assert resolve_hardware(job(node="dgx-a100"), nvlink_island_gpus=2).nvlink_island_gpus == 2


def test_gpu_spec_defines_a_new_gpu():
    hw = resolve_hardware(job(gpu="mi300x", gpu_spec={"memory_gib": 192.0, "peak_tflops": 1307.0,
                                                      "nvlink_gbps": 448.0}))
    assert hw.gpu.memory_bytes == 192 * 2**30
    assert hw.gpu.peak_flops_per_s("bf16") == pytest.approx(1307e12)
    assert hw.gpu.nvlink_bytes_per_s == pytest.approx(448e9)


def test_unknown_name_raises_with_suggestion():
    with pytest.raises(ValueError, match="did you mean 'ib-ndr400'"):
        resolve_hardware(job(fabric="ib-ndr"))


def test_a_node_profile_takes_its_gpu_variants_and_refuses_others():
    # DGX A100 320GB (40 GB A100s) and 640GB (80 GB) are one server model: the profile's islands and
    # NICs, the chosen GPU's memory and HBM bandwidth.
    small = resolve_hardware(job(node="dgx-a100", gpu="a100-40gb", gpus_per_node=8))
    assert small.gpu.name == "a100-40gb" and small.gpu.memory_bytes == 40 * 2**30
    assert (small.nvlink_island_gpus, small.nics_per_node) == (8, 8)
    assert small.gpu.hbm_bytes_per_s < resolve_hardware(job(node="dgx-a100", gpus_per_node=8)).gpu.hbm_bytes_per_s
    with pytest.raises(ValueError, match="node profile 'dgx-h100' has h100-80gb GPUs .got 'a100-40gb'.; "
                                         "set cluster.gpu=h100-80gb"):
        resolve_hardware(job(node="dgx-h100", gpu="a100-40gb", gpus_per_node=8))
    with pytest.raises(ValueError, match="'dgx-a100' has a100-80gb or a100-40gb GPUs"):
        resolve_hardware(job(node="dgx-a100", gpu="h100-80gb", gpus_per_node=8))


def test_the_power_limited_h100_sits_between_the_nvl_and_the_sxm_and_holds_torchtitans_peaks():
    # torchtitan's Grand Teton H100s (benchmarks/llama3_h100_202412_torchtitan.md): "between SXM and NVL", 96 GB
    # HBM2e at 2.4 TB/s; its tables report peaks up to 84.9 GiB on them, which the catalog's memory must hold.
    hw = resolve_hardware(job(node="grand-teton-h100", gpu="h100-96gb-500w", fabric="roce-400", nodes=2))
    sxm, gpu = GPUS["h100-80gb"], hw.gpu
    nvl_dense_bf16 = 1671e12 / 2  # H100 NVL datasheet, 1,671 TFLOPS with sparsity
    assert nvl_dense_bf16 < gpu.bf16_flops_per_s < sxm.bf16_flops_per_s
    assert gpu.fp8_flops_per_s / gpu.bf16_flops_per_s == pytest.approx(2.0, rel=0.01)
    assert gpu.hbm_bytes_per_s == pytest.approx(2.4e12) and gpu.memory_bytes > 84.9 * 2**30
    assert hw.gpus_per_node == 8 and hw.nvlink_island_gpus == 8 and hw.nics_per_node == 8
