"""Blackwell systems in the catalog and multi-node NVLink domains (issue 26): DGX B200 / B300 (8 GPUs, NVLink inside
the node) and GB200 / GB300 NVL72 (Slurm nodes of 4 GPUs, one NVLink domain of 72 over 18 of them). A group
inside one domain is priced over NVLink whatever nodes it spans; the same group on DGX B200 crosses the fabric."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import comm
from hpctrain.plan.comm import collective_s, group_link
from hpctrain.plan.hardware import FABRICS, GPUS, NODES, POWER_SCALED_FROM, check_catalog_names, resolve_hardware
from hpctrain.plan.placement import rank_order

MIB = 2**20


def job(model: dict | None = None, **cluster):
    return job_from_dict({"name": "t", "model": model or {"preset": "tiny"}, "cluster": cluster})


def nvl72(nodes: int, **extra):
    return resolve_hardware(job(nodes=nodes, gpus_per_node=4, gpu="gb200-186gb", node="gb200-nvl72",
                                fabric="ib-ndr400", **extra))


def dgx_b200(nodes: int):
    return resolve_hardware(job(nodes=nodes, gpus_per_node=8, gpu="b200-180gb", node="dgx-b200", fabric="ib-ndr400"))


@pytest.mark.parametrize("name, mib, bf16, fp8, hbm, host", [
    ("b200-180gb", 183359, 2250, 4500, 7672, 64),
    ("b300-288gb", 275040, 2250, 4500, 8000, 64),
    ("gb200-186gb", 189471, 2500, 5000, 8000, 225),  # NVLink-C2C, not PCIe; computes at the power rule's share (below)
    ("gb300-288gb", 284208, 2500, 5000, 8000, 225),
])
def test_blackwell_gpus_carry_their_datasheet_figures(name, mib, bf16, fp8, hbm, host):
    gpu = GPUS[name]
    assert gpu.memory_bytes == mib * MIB
    assert (gpu.bf16_flops_per_s, gpu.fp16_flops_per_s, gpu.fp8_flops_per_s) == (bf16 * 1e12, bf16 * 1e12, fp8 * 1e12)
    assert gpu.hbm_bytes_per_s == hbm * 1e9 and gpu.pcie_bytes_per_s == host * 1e9
    assert gpu.nvlink_bytes_per_s == 900e9  # NVLink 5: 1.8 TB/s both directions
    assert gpu.mxfp8 and gpu.peak_flops_per_s("fp8") == gpu.bf16_flops_per_s  # MFU stays quoted against bf16
    assert not any(GPUS[old].mxfp8 for old in ("h100-80gb", "h200-141gb", "a100-80gb", "l40s"))


@pytest.mark.parametrize("name", sorted(POWER_SCALED_FROM))
def test_a_gpu_at_another_power_limit_takes_the_cube_root_of_the_power_ratio(name):
    # The power rule (hardware.POWER_SCALED_FROM): the same GPU's sustained tensor rates scale as (watts / watts of the
    # reference)^(1/3), to the catalog's rounding.
    reference, reference_watts, watts = POWER_SCALED_FROM[name]
    scale = (watts / reference_watts) ** (1 / 3)
    gpu, ref = GPUS[name], GPUS[reference]
    for precision in ("bf16", "fp16", "fp32"):  # (GB200's plain FP32: its page's 80, within 0.4 % of the rule)
        assert gpu.rate_flops_per_s(precision) == pytest.approx(ref.rate_flops_per_s(precision) * scale, rel=5e-3)
    assert gpu.fp8_rate_flops_per_s == pytest.approx(ref.fp8_rate_flops_per_s * scale, rel=2e-3)


def test_blackwell_fp8_gemms_run_at_the_rate_measured_beside_h100():
    # hardware.FP8_MEASURED_OVER_H100: one cuBLASLt FP8 benchmark on both (Azure AI-benchmarking-guide), four large
    # shapes, GB200 / H100 = 2.230, 2.111, 2.044, 2.143
    gb200, b200, h100 = GPUS["gb200-186gb"], GPUS["b200-180gb"], GPUS["h100-80gb"]
    assert gb200.fp8_rate_flops_per_s / h100.fp8_rate_flops_per_s == pytest.approx(2.132, abs=1e-3)
    assert gb200.fp8_rate_flops_per_s == pytest.approx(4219e12, rel=1e-3)
    # below the power rule's 4,782 (bf16 keeps the rule: no measurement), B200 at GB200's rate under the rule
    assert gb200.fp8_rate_flops_per_s < 2 * gb200.rate_flops_per_s("bf16")
    assert gb200.rate_flops_per_s("bf16") == pytest.approx(2391e12, rel=1e-3)
    assert b200.fp8_rate_flops_per_s == pytest.approx(3970e12, rel=1e-3) and b200.rate_flops_per_s("bf16") == 2250e12
    # Blackwell Ultra (other silicon) has no measurement: its page's peak
    assert GPUS["gb300-288gb"].fp8_rate_flops_per_s == GPUS["gb300-288gb"].fp8_flops_per_s == 5000e12


def test_gb200_computes_at_what_its_power_sustains_and_quotes_mfu_against_its_datasheet():
    gb200, b200 = GPUS["gb200-186gb"], GPUS["b200-180gb"]
    # under the NVL72 page's 2,500 TFLOPS bf16 (5,000 FP8), over B200's 2,250
    assert b200.rate_flops_per_s("bf16") < gb200.rate_flops_per_s("bf16") < gb200.peak_flops_per_s("bf16") == 2500e12
    assert gb200.fp8_rate_flops_per_s < gb200.fp8_flops_per_s == 5000e12
    # the planner's step slows by that share; its MFU stays quoted against the page (as telemetry's)
    hw = resolve_hardware(job(nodes=2, gpus_per_node=4, gpu="gb200-186gb", node="gb200-nvl72", fabric="ib-ndr400"))
    assert hw.gpu.peak_flops_per_s("bf16") == 2500e12 and hw.gpu.power_sustained == pytest.approx(0.9564, abs=1e-4)
    # a cluster.gpu_spec peak is the user's own figure: taken as sustained
    spec = {"peak_tflops": 2000, "memory_gib": 180, "nvlink_gbps": 900}
    custom = resolve_hardware(job(nodes=2, gpus_per_node=4, gpu="gb200-186gb", node="gb200-nvl72",
                                  fabric="ib-ndr400", gpu_spec=spec))
    assert custom.gpu.rate_flops_per_s("bf16") == 2000e12


def test_blackwell_node_profiles():
    assert (NODES["dgx-b200"].gpus_per_node, NODES["dgx-b200"].nics_per_node, NODES["dgx-b200"].fabric) == (8, 8, "ib-ndr400")
    assert (NODES["dgx-b300"].gpu, NODES["dgx-b300"].fabric) == ("b300-288gb", "ib-xdr800")
    assert FABRICS["ib-xdr800"].nic_bytes_per_s == 100e9  # ConnectX-8: 800 Gb/s
    for name, gpu in (("gb200-nvl72", "gb200-186gb"), ("gb300-nvl72", "gb300-288gb")):
        profile = NODES[name]
        assert (profile.gpu, profile.gpus_per_node, profile.nvlink_domain_gpus, profile.nics_per_node) == (gpu, 4, 72, 4)


def test_the_nvlink_domain_resolves_from_the_profile_the_job_and_the_node_size():
    hw = nvl72(64)
    assert (hw.gpus_per_node, hw.nvlink_island_gpus, hw.nvlink_domain_gpus, hw.multi_node_nvlink) == (4, 4, 72, True)
    assert nvl72(64, nvlink_domain_gpus=64).nvlink_domain_gpus == 64  # 16 of 18 trays per rack (--segment=16)
    two_per_tray = resolve_hardware(job(nodes=8, gpus_per_node=2, gpu="gb200-186gb", node="gb200-nvl72"))
    assert two_per_tray.nvlink_domain_gpus == 36  # 18 trays x the job's 2 GPUs each
    dgx = resolve_hardware(job(nodes=4, gpu="h100-80gb", node="dgx-h100", fabric="ib-ndr400"))
    assert (dgx.nvlink_domain_gpus, dgx.multi_node_nvlink) == (8, False)
    assert dgx_b200(4).nvlink_domain_gpus == 8


def test_a_cluster_that_cannot_be_refused_in_one_line():
    assert check_catalog_names(job(nodes=2, gpus_per_node=8, gpu="gb200-186gb", node="gb200-nvl72")) == [
        "cluster.gpus_per_node: node profile 'gb200-nvl72' has 4 GPUs per node (got 8); set cluster.gpus_per_node=4"]
    assert check_catalog_names(job(nodes=2, gpus_per_node=4, gpu="gb200-186gb", node="gb200-nvl72",
                                   nvlink_domain_gpus=70)) == [
        "cluster.nvlink_domain_gpus: an NVLink domain is whole nodes, a multiple of cluster.gpus_per_node=4 (got 70); "
        "set a multiple of it"]


def test_domain_share_counts_the_straddling_group():
    hw = nvl72(64)  # 256 GPUs in racks of 72: 72, 72, 72 and 40
    assert comm.domain_share(hw, 8) == 8  # 72 = 9 x 8
    assert comm.domain_share(hw, 16) == 8  # the block 64-79 has 8 GPUs in each of the first two racks
    assert comm.domain_share(hw, 64) == 8  # the block 64-127: 8 in rack 0, 56 in rack 1
    assert not comm.groups_in_domains(hw, 16)
    segments = nvl72(64, nvlink_domain_gpus=64)
    assert comm.domain_share(segments, 64) == 64 and comm.groups_in_domains(segments, 16)
    assert comm.domain_share(segments, 128) == 64  # two domains of 64 each


def test_a_dp_group_of_16_across_four_trays_rides_nvlink_on_nvl72_and_the_fabric_on_dgx_b200():
    # tp 4 (one tray), dp 16 over 64 GPUs: the dp group spans 16 trays of one rack, or 8 DGX B200.
    message = 1e9
    on_nvl72 = group_link(nvl72(16), 4, 16)
    assert (on_nvl72.bandwidth_bytes_per_s, on_nvl72.nodes) == (900e9 * comm.NVLINK_EFFICIENCY, 1)
    assert collective_s(message, on_nvl72, all_reduce=False) == pytest.approx(
        15 / 16 * message / 630e9 + comm.RING_BASE_LATENCY_S + 15 * comm.NVLINK_STEP_LATENCY_S)
    on_dgx = group_link(dgx_b200(8), 4, 16)
    # two members per DGX B200: the collective spreads over their two NDR NICs (comm.group_link)
    assert (on_dgx.bandwidth_bytes_per_s, on_dgx.nodes) == (2 * 8 * 50e9 * 0.90 / 8, 8)
    assert collective_s(message, on_dgx, all_reduce=False) == pytest.approx(
        15 / 16 * message / 90e9 + comm.RING_BASE_LATENCY_S + 8 * comm.NVLINK_STEP_LATENCY_S
        + 7 * comm.NET_STEP_LATENCY_S)
    # past the rack the same group leaves NVLink: dp 32 over 128 GPUs spans two racks, 16 members in each, whose
    # 16 NICs (45 GB/s each) would carry more than NVLink does: NVLink bounds it; one NIC for a point-to-point
    two_racks = group_link(nvl72(32, nvlink_domain_gpus=64), 4, 32)
    assert (two_racks.bandwidth_bytes_per_s, two_racks.nodes) == (900e9 * comm.NVLINK_EFFICIENCY, 2)
    assert group_link(nvl72(32, nvlink_domain_gpus=64), 4, 32, collective=False).bandwidth_bytes_per_s == 45e9


def test_an_ep_group_of_64_rides_nvlink_inside_a_domain():
    message = 1e9
    rack = nvl72(64, nvlink_domain_gpus=64)
    where = comm.ep_placement(rack, 1, 4, 64)
    assert (where.nodes, where.nvlink_peers, where.crosses_nodes, where.crosses_fabric) == (16, 64, True, False)
    assert comm.all_to_all_s(message, rack, where) == pytest.approx(
        message * 63 / 64 / (900e9 * comm.A2A_NVLINK_EFFICIENCY) + comm.RING_BASE_LATENCY_S
        + comm.NVLINK_STEP_LATENCY_S)
    dgx = dgx_b200(32)
    where = comm.ep_placement(dgx, 1, 4, 64)
    assert (where.nvlink_peers, where.crosses_fabric) == (8, True)
    assert comm.all_to_all_s(message, dgx, where) == pytest.approx(
        message * 56 / 64 / 45e9 + comm.RING_BASE_LATENCY_S + comm.NET_STEP_LATENCY_S)
    # racks of 72 with 256 GPUs: the ep group on slots 64-79 has 8 peers in each rack, and sets the step
    straddling = comm.ep_placement(nvl72(64), 1, 4, 16)
    assert (straddling.nvlink_peers, straddling.crosses_fabric) == (8, True)
    assert comm.ep_placement(nvl72(16), 1, 1, 64).crosses_fabric is False  # 64 GPUs: all in one rack


@pytest.mark.parametrize("domain, ep", [(64, 16), (64, 64), (72, 8), (72, 16)])
def test_the_placement_keeps_ep_groups_where_the_cost_model_puts_them(domain, ep):
    hw = nvl72(64, nvlink_domain_gpus=domain)
    tp, pp, dp = 1, 4, 64
    order = rank_order(tp, pp, dp, hw.gpus_per_node, pipeline_outermost=comm.pipeline_outermost(ep))
    slot_of = {rank: slot for slot, rank in enumerate(order or range(hw.world_size))}
    where = comm.ep_placement(hw, tp, pp, ep)
    fewest = ep
    for stage in range(pp):
        for first in range(0, dp * tp, ep):
            domains = [slot_of[stage * dp * tp + first + i] // domain for i in range(ep)]
            fewest = min(fewest, min(domains.count(d) for d in set(domains)))
    assert fewest == where.nvlink_peers
    assert where.crosses_fabric == (fewest < ep)


def test_moe_all_to_all_on_nvl72_against_dgx_b200():
    from hpctrain.plan.cost import step_cost
    from hpctrain.plan.cost_setup import CostSetup
    from hpctrain.plan.search import busiest_rank
    from hpctrain.plan.stages import balanced_stage_split

    model = job_from_dict({"name": "q", "model": {"preset": "qwen3-235b-a22b", "seq_len": 4096}}).model
    split = balanced_stage_split(model, 4, 1)
    layers, head, params = busiest_rank(model, split, 4, 1, 16)

    def cost(hw):
        return step_cost(model, hw, CostSetup(
            tp=1, pp=4, dp=64, micro_batch=1, micro_batches=8, virtual_stages=1, ac="selective", zero=1,
            offload_optimizer=False, precision="bf16", max_rank_layers=layers, max_rank_has_head=head,
            rank_params=params, ep=16), global_batch=512)

    rack, dgx = cost(nvl72(64, nvlink_domain_gpus=64)), cost(dgx_b200(32))
    assert not rack.a2a_crosses_nodes and dgx.a2a_crosses_nodes
    assert dgx.a2a_s > 5 * rack.a2a_s  # 45 GB/s of NIC per GPU against 720 GB/s of NVLink
    assert cost(nvl72(64)).a2a_crosses_nodes  # racks of 72: the straddling group


def test_plan_on_nvl72_reports_the_domain():
    from hpctrain.plan import plan_job
    from hpctrain.plan.report import machines

    result = plan_job(job_from_dict({"name": "t", "model": {"preset": "llama3-8b"}, "train": {"global_batch": 64},
                                     "cluster": {"nodes": 16, "gpus_per_node": 4, "gpu": "gb200-186gb",
                                                 "node": "gb200-nvl72", "fabric": "ib-ndr400"}}))
    assert result.to_json()["cluster"]["nvlink_domain_gpus"] == 72
    assert machines(result.hardware) == "16 nodes x 4, NVLink islands of 4, NVLink domains of 72, ib-ndr400"
    assert result.best.tp <= 4  # TP stays inside a node (config: parallel.tp <= gpus_per_node)
