"""Collective communication time: alpha-beta over hierarchical rings, and FSDP's per-unit overlap.

A collective over a group of ranks is a ring (Patarasuk & Yuan 2009): all-reduce moves 2(n-1)/n of
the message through every rank, all-gather and reduce-scatter (n-1)/n, and it takes 2(n-1) or
(n-1) ring steps, each paying a hop latency. That is NCCL's own cost model (src/graph/tuning.cc,
`ncclTopoTuneModel`): latency = base + (intra-node steps) x intra hop + (inter-node steps) x inter
hop, so the latency term grows with the ring size; bandwidth = bus bandwidth of the slowest link.

Hierarchy: a group inside one node rides NVLink, and so does a group inside one multi-node NVLink domain
(GB200 / GB300 NVL72: 72 GPUs over 18 nodes, `Hardware.nvlink_domain_gpus`); a group that leaves them is bounded
by the fabric: a collective by the NICs of the members it has in a node, a point-to-point transfer by its own
(see `group_link` for why), with its ring steps between nodes (or domains) paying the network's hop latency.

FSDP / ZeRO (`fsdp_exposed_s`): parameters are all-gathered and gradients reduce-scattered once
per FSDP unit (a transformer block) per (micro-)step. The gather of unit i+1 is prefetched while
unit i computes, the reduce-scatter of unit i runs while unit i-1 computes its backward, so each
unit's collective hides only behind that unit's compute: exposed = the first gather + the part of
every other unit's collective that its compute does not cover + the last reduce-scatter.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

from hpctrain.plan.hardware import Hardware

# NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, `baseLat` and `hwLat`, Ring algorithm,
# Simple protocol, the one NCCL picks for the large messages of training): 8.4 us per collective,
# 3.4 us per ring step over NVLink, 9.6 us per ring step that crosses the network.
RING_BASE_LATENCY_S = 8.4e-6
NVLINK_STEP_LATENCY_S = 3.4e-6
NET_STEP_LATENCY_S = 9.6e-6
# NCCL bus bandwidth over NVLink / NVLink line rate: nccl-tests all-reduce busbw is ~200 GB/s on 8
# A100-SXM-80GB over NVLink (NVIDIA/nccl-tests issue #149) and 208 GB/s on an NV12 pair (issue #178),
# of the 300 GB/s per direction.
NVLINK_EFFICIENCY = 0.70
# Third-generation NVSwitch (DGX/HGX H100 and H200) reduces in the switch (NVLink SHARP, NCCL's NVLS algorithm): each
# GPU sends its data once instead of twice, so an all-reduce inside the node reaches a bus bandwidth above the line
# rate: "476GB/s looks to be in the expected range for H100" (NCCL maintainer, NVIDIA/nccl-tests issue #290, an
# 8-GPU all_reduce_perf over NVLink SHARP). Taken for every collective inside such a node (NCCL also runs
# all-gather and reduce-scatter over NVLS since 2.19): 476 of the 450 GB/s per direction.
NVLS_GPUS = ("h100-80gb", "h100-96gb-500w", "h200-141gb")
NVLS_EFFICIENCY = 476.0 / 450.0
# While FSDP's collectives run behind compute they take SMs from it: NCCL runs one CUDA block per
# channel (NCCL user guide, NCCL_MIN_CTAS / NCCL_MAX_CTAS). The channel count is chosen by topology;
# 16 is an assumption (two per NIC on an 8-NIC node). Of an A100's 108 SMs (A100 whitepaper) that is
# ~15 %, of an H100 SXM's 132 (H100 whitepaper) ~12 %: hidden communication still costs that share
# of the compute it hides behind.
NCCL_CHANNELS = 16
# B200: 148 SMs (device query, torchao PR #4002); B300, GB200 and GB300 taken as B200's (a B300 SXM6 AC's device query
# shows 148 as well; NVIDIA publishes no count for the superchips' GPUs).
SM_COUNT = {"a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132, "h200-141gb": 132, "v100-32gb": 80,
            "l40s": 142, "b200-180gb": 148, "b300-288gb": 148, "gb200-186gb": 148, "gb300-288gb": 148}


def overlap_slowdown(gpu_name: str) -> float:
    """Fraction of compute lost while a collective overlaps it (NCCL's blocks on their SMs)."""
    sms = SM_COUNT.get(gpu_name)
    return NCCL_CHANNELS / sms if sms else 0.0


@dataclass(frozen=True)
class Link:
    """What one member of a group sees: bus bandwidth (bytes/s) and the ring's per-step latencies."""

    bandwidth_bytes_per_s: float
    ranks: int
    nodes: int  # the NVLink domains the group spans: nodes, or multi-node NVLink domains (1 = all on NVLink)


def group_link(hw: Hardware, span_slots: int, ranks: int, collective: bool = True) -> Link:
    """The link of a group whose members sit `span_slots` apart in the placement (tp innermost, then
    pp, then dp): NVLink inside a node (or NVLink domain); across them, the fabric.

    A collective (`collective`: all-gather, reduce-scatter, all-reduce) over members that leave the node sees as
    many NICs as the group has members in a node. NCCL runs a collective over several channels, each its own ring
    through every member, and gives each channel's hop between nodes another rail NIC (NCCL user guide,
    NCCL_MIN_NCHANNELS / NCCL_CROSS_NIC; nccl-tests busbw: 3 nodes x 4 HDR NICs reach 85-96 of 100 GB/s all-reduce
    busbw, NVIDIA/nccl-tests issue #119), so a node that holds k members of the group moves its share over k NICs:
    k x one NIC per member, NVLink's at most. A point-to-point transfer (`collective=False`: pipeline activations,
    the CP ring's K/V) leaves through its sender's own NIC: one NIC.
    The calibration set bears the aggregate out (bench/planner_accuracy.py): llm-foundry's FSDP runs of MPT-70B on
    8-GPU nodes (A100 and H100) and NeMo 24.07's GPT-3 20B (DP 32 over 8 nodes, 4 members each) run at the published
    throughput with it and 13-23 % too slow with one NIC per member, the published MPT-70B layouts ranked 8th and
    12th instead of 1st; so do torchtitan's FSDP2 rows on DGX A100 (Llama 2 13B: 2,162 tokens/s needs >= 27 GB/s per
    GPU of collectives, more than one HDR NIC's 25). One publication's software did not get there: DeepSpeed's ZeRO-3
    in Narayanan et al. 2021, table 2, runs the same step time, 65 s, on 768 and on 1536 DGX A100 GPUs at a fixed
    global batch, its ~1 TB per GPU of gathers and reduce-scatters at ~16 GB/s per GPU, two thirds of one NIC; those
    rows say so (corpus field `one_nic_collectives`, `Hardware.nic_aggregation` False: one NIC per member).
    """
    if ranks <= 1:
        return Link(float("inf"), ranks, 1)
    nvlink = hw.intra_node_bytes_per_s * (NVLS_EFFICIENCY if hw.gpu.name in NVLS_GPUS else NVLINK_EFFICIENCY)
    if span_slots * ranks <= hw.gpus_per_node:
        return Link(nvlink, ranks, 1)
    if hw.multi_node_nvlink and groups_in_domains(hw, span_slots * ranks):
        return Link(nvlink, ranks, 1)  # across nodes of one NVLink domain: NVLink switch trays, no NIC
    # members per node, or per multi-node domain: the ring crosses the fabric between them (at least once: a group
    # that fits a domain's size but straddles two of them, `domain_share`, spans two)
    members_per_node = max(1, hw.nvlink_domain_gpus // span_slots)
    nodes = max(2, -(-ranks // members_per_node))
    per_gpu_nic = hw.node_fabric_bytes_per_s / hw.gpus_per_node
    nics = min(members_per_node, ranks) if collective and hw.nic_aggregation else 1
    return Link(min(nvlink, nics * per_gpu_nic), ranks, nodes)


def domain_share(hw: Hardware, extent: int) -> int:
    """The fewest slots that a group of `extent` consecutive slots shares with one NVLink domain, over the job's
    groups (1 <= answer <= extent; extent when every group lies inside one domain).

    The placement (plan/placement.py) gives each group of a kind an aligned block of slots: tp innermost, the
    group of span s and r ranks the block [k s r, (k + 1) s r). The job's nodes fill domains of
    `nvlink_domain_gpus` in Slurm's node order, the last one possibly partial. A block straddles a domain boundary
    when the domain is not a multiple of it (a 72-GPU NVL72 rack holds four blocks of 16 and half of a fifth): the
    slowest group sets the step, so such a layout is priced as the straddling group sees it."""
    return _domain_share(extent, min(hw.nvlink_domain_gpus, hw.world_size), hw.world_size)


@functools.lru_cache(maxsize=4096)
def _domain_share(extent: int, domain: int, world: int) -> int:
    if domain % extent == 0:
        return extent
    # block k starts at k * extent mod domain inside its domain: the starts repeat after domain / gcd blocks
    period = domain // math.gcd(extent, domain)
    fewest = extent
    for block in range(min(world // extent, period)):
        start = block * extent % domain
        first = min(extent, domain - start)  # the block's slots in the domain it starts in
        last = (extent - first) % domain  # and in the domain it ends in, past whole domains between
        fewest = min(fewest, first, last or fewest)
    return fewest


def groups_in_domains(hw: Hardware, extent: int) -> bool:
    """Every group of `extent` consecutive slots lies inside one NVLink domain (`domain_share`)."""
    return domain_share(hw, extent) == extent


def ring_latency_s(link: Link, all_reduce: bool) -> float:
    """Base + per-step latency of a ring collective: (n-1) steps (x2 for all-reduce), of which the
    (nodes-1) (x2) that cross the network pay the network hop (NCCL tuning.cc)."""
    if link.ranks <= 1:
        return 0.0
    factor = 2 if all_reduce else 1
    steps = factor * (link.ranks - 1)
    inter = factor * (link.nodes - 1)
    return RING_BASE_LATENCY_S + (steps - inter) * NVLINK_STEP_LATENCY_S + inter * NET_STEP_LATENCY_S


def collective_s(message_bytes: float, link: Link, all_reduce: bool) -> float:
    """Ring all-reduce (2(n-1)/n) or all-gather / reduce-scatter ((n-1)/n) of a message per rank."""
    if link.ranks <= 1 or message_bytes <= 0:
        return 0.0
    factor = (2.0 if all_reduce else 1.0) * (link.ranks - 1) / link.ranks
    return factor * message_bytes / link.bandwidth_bytes_per_s + ring_latency_s(link, all_reduce)


def overlapped_s(units: int, comm_per_unit_s: float, compute_per_unit_s: float, first_s: float,
                 slowdown: float = 0.0) -> float:
    """Exposed time of `units` collectives, each hidden behind one unit's compute: the first one
    (`first_s`: a gather before any compute, or a reduce after the last) never hides, every other
    costs its unit max(c - w, c s / (1 + s)) beyond the unit's compute w.

    While a collective c is in flight the compute runs 1 + s times slower (NCCL's blocks hold
    `overlap_slowdown` of the SMs). Compute-bound unit (c < w (1 + s)): in c the compute does
    c / (1 + s) of its work and the rest at full speed, so the unit takes w + c s / (1 + s).
    Communication-bound (c >= w (1 + s)): the slowed compute finishes under the collective and
    the unit takes c. The slowdown is thus paid only where compute is the critical path."""
    if units <= 0 or comm_per_unit_s <= 0:
        return 0.0
    hidden_cost = comm_per_unit_s * slowdown / (1.0 + slowdown)
    return first_s + (units - 1) * max(comm_per_unit_s - compute_per_unit_s, hidden_cost)


class FsdpStep(NamedTuple):
    """What FSDP does in one step on the busiest rank (runtime/parallel/fsdp.py's table). A named tuple: one is built
    for each layout a search costs, ~5x faster than a frozen dataclass."""

    units: int  # FSDP units (transformer blocks) on the rank
    gather_s: float  # one unit's parameter all-gather
    reduce_s: float  # one unit's gradient reduce-scatter (fp32)
    forward_per_unit_s: float  # one micro-batch's forward of one unit
    backward_per_unit_s: float  # one micro-batch's backward (+ recompute) of one unit
    micro_batches: int
    gathers_in_backward: bool  # zero 3 without pipelining reshards after forward
    gather_every_micro_batch: bool  # False under pipelining: gathered once per step
    reduce_every_micro_batch: bool  # zero 2/3 without pipelining; else the last micro-batch only
    slowdown: float = 0.0  # compute lost while a collective overlaps it (`overlap_slowdown`)


def fsdp_exposed_s(s: FsdpStep) -> tuple[float, float]:
    """(exposed, total) communication time of FSDP's collectives in one step.

    Forward of a gathering micro-batch: the first unit's gather, then each unit's gather beyond its
    predecessor's forward. Backward: zero 3 re-gathers each unit (prefetched one unit ahead) and,
    in a reducing micro-batch, reduce-scatters it after its backward; both share the links while
    the next unit computes, so the first gather and the last reduce are exposed in full."""
    m = s.micro_batches
    gather_rounds = m if s.gather_every_micro_batch else 1
    reduce_rounds = m if s.reduce_every_micro_batch else 1
    exposed = gather_rounds * overlapped_s(s.units, s.gather_s, s.forward_per_unit_s, s.gather_s, s.slowdown)
    back_gather = s.gather_s if s.gathers_in_backward else 0.0
    both = back_gather + s.reduce_s
    exposed += reduce_rounds * overlapped_s(s.units, both, s.backward_per_unit_s, both, s.slowdown)
    exposed += (m - reduce_rounds) * overlapped_s(s.units, back_gather, s.backward_per_unit_s, back_gather,
                                                 s.slowdown)
    backward_gathers = m if s.gathers_in_backward else 0
    total = s.units * ((gather_rounds + backward_gathers) * s.gather_s + reduce_rounds * s.reduce_s)
    return exposed, total


# Expert parallelism's all-to-all (token dispatch and combine, runtime/parallel/expert.py). Each rank sends
# every peer of its ep group the routed copies bound for that peer's experts and receives as many: no ring,
# one exchange whose bytes leave the rank over NVLink for the peers in its node and over its NIC for the
# others, both at once (NCCL posts every peer's send and receive in one group; DeepSeek-V3, Liu et al. 2024,
# arXiv 2412.19437, section 3.2.2, overlaps its IB and NVLink legs the same way). The slower leg sets the time.
# A2A_NVLINK_EFFICIENCY: DeepSeek-V3 (same section) reaches 160 GB/s over the H800's NVLink (200 GB/s per
# direction, H800 datasheet) in its dispatch and combine kernels: 0.80 of the line rate. Across nodes the
# NIC's achievable rate (the fabric's efficiency, hardware.py): the same paper's "IB (50 GB/s)" is a 400 Gb/s
# NIC's line rate, nccl-tests reaches 46-48 GB/s of it (hardware.py's InfiniBand note).
A2A_NVLINK_EFFICIENCY = 0.80


@dataclass(frozen=True)
class EpPlacement:
    """Where one ep group's ranks sit: `in_node` of its `ranks` share each node, `on_nvlink` (at least) share
    one NVLink domain with each rank (ep_placement; 0 = in_node, NVLink inside a node only)."""

    ranks: int
    in_node: int
    on_nvlink: int = 0

    @property
    def nodes(self) -> int:
        return -(-self.ranks // self.in_node)

    @property
    def crosses_nodes(self) -> bool:
        return self.ranks > self.in_node

    @property
    def nvlink_peers(self) -> int:
        """Ranks of the group (the rank itself included) that a rank reaches over NVLink."""
        return self.on_nvlink or self.in_node

    @property
    def fabric_segments(self) -> int:
        """The parts of the group that NVLink joins and the fabric separates: its nodes, or its NVLink domains."""
        return -(-self.ranks // self.nvlink_peers)

    @property
    def crosses_fabric(self) -> bool:
        """Some of the group's all-to-all leaves over the NICs (a group beyond one node or one NVLink domain)."""
        return self.ranks > self.nvlink_peers


def pipeline_outermost(ep: int) -> bool:
    """The slot order of a layout (plan/placement.py): tp innermost, then pp, then dp for dense layouts (a
    pipeline on as few nodes as possible); with expert parallelism tp, then dp, then pp outermost, so that an
    ep group (ep consecutive ranks of a stage's dp x cp x tp, runtime/parallel/expert.py) shares NVLink before
    any pipeline neighbour does: its all-to-alls move top_k x hidden per token several times a layer, a
    pipeline send one hidden per token a stage (Megatron-Core's default rank order tp-cp-ep-dp-pp puts pp
    outermost too, megatron/core/parallel_state.py `order`)."""
    return ep > 1


def pp_span(tp: int, dp: int, ep: int) -> int:
    """Slots between pipeline neighbours (group_link's span_slots)."""
    return tp * dp if pipeline_outermost(ep) else tp


def dp_span(tp: int, pp: int, ep: int) -> int:
    """Slots between data-parallel peers (group_link's span_slots)."""
    return tp if pipeline_outermost(ep) else tp * pp


def ep_placement(hw: Hardware, tp: int, pp: int, ep: int) -> EpPlacement:
    """The ep group of a (tp, pp) layout: ep consecutive slots (pipeline_outermost): whole tp groups side by
    side, as many in a node as it holds; on multi-node NVLink, as many of them in one NVLink domain as the
    straddling group has there (`domain_share`); with context parallelism the same (the placement walks dp x cp as
    one dimension, cp inside dp, as the runtime's grid and its ep groups do)."""
    in_node = max(1, min(ep, hw.gpus_per_node))
    if ep <= hw.gpus_per_node or not hw.multi_node_nvlink:
        return EpPlacement(ep, in_node)
    return EpPlacement(ep, in_node, max(in_node, domain_share(hw, ep)))


def all_to_all_s(message_bytes: float, hw: Hardware, where: EpPlacement,
                 fabric_copies: float | None = None, top_k: int = 1) -> float:
    """One all-to-all of `message_bytes` per rank over an ep group: (ep-1)/ep of it leaves the rank, the
    NVLink peers' share (in its node, or in its multi-node NVLink domain) over NVLink and the rest over the rank's
    share of the node's NICs (hierarchical when the group leaves NVLink); plus NCCL's base latency and one hop (a
    network hop when it crosses the fabric).

    `fabric_copies` (a node-deduplicating dispatcher, `dedup_fabric_copies`): of the `top_k` routed copies of a
    token that `message_bytes` carries, only this many cross the fabric (one per remote node, or NVLink domain,
    it reaches), and the receiving GPU forwards them over NVLink to the GPUs of their experts, so NVLink carries
    every copy that does not land on its relay: (top_k - 1 / peers) of top_k, an upper bound of the forwarding."""
    ep = where.ranks
    if ep <= 1 or message_bytes <= 0:
        return 0.0
    nvlink = hw.intra_node_bytes_per_s * A2A_NVLINK_EFFICIENCY
    peers = where.nvlink_peers
    inter = 0.0
    if fabric_copies is not None and where.crosses_fabric:
        per_copy = message_bytes / top_k
        intra = per_copy * top_k * (peers - 1) / peers / nvlink
        nic = min(nvlink, hw.node_fabric_bytes_per_s / hw.gpus_per_node)
        inter = per_copy * fabric_copies / nic
    else:
        intra = message_bytes * (peers - 1) / ep / nvlink
        if where.crosses_fabric:
            nic = min(nvlink, hw.node_fabric_bytes_per_s / hw.gpus_per_node)
            inter = message_bytes * (ep - peers) / ep / nic
    hop = NET_STEP_LATENCY_S if where.crosses_fabric else NVLINK_STEP_LATENCY_S
    return max(intra, inter) + RING_BASE_LATENCY_S + hop


# Node-deduplicating dispatch (DeepEP's normal kernels, Megatron-Core's "flex" dispatcher with the deepep or
# hybridep backend): a token bound for several experts on one remote node crosses the fabric once, to the GPU
# of the same rail there, which forwards it over NVLink to the GPUs holding those experts (Liu et al. 2024,
# DeepSeek-V3, arXiv 2412.19437, section 3.2.2: "each token ... first transmitted via IB to the GPUs with the
# same in-node index on its target nodes ... then forwarded via NVLink"; deepseek-ai/DeepEP README: its RDMA
# "bottleneck bandwidth" counts those deduplicated bytes). NCCL's all-to-all (Megatron's alltoall dispatcher,
# torchtitan, hpctrain's runtime) sends every routed copy: (ep - in_node) / ep of top_k copies cross.
DEDUP_DISPATCHERS = ("deepep", "hybridep")


def dedup_fabric_copies(experts: int, top_k: int, where: EpPlacement) -> float:
    """Expected remote nodes a token reaches when its top_k experts are drawn without replacement, uniformly
    (a balanced router), from `experts` spread evenly over the ep group's nodes: (nodes - 1) x P(a given
    remote node holds at least one of them) = (nodes - 1) x (1 - C(E - E_n, k) / C(E, k)), E_n = experts per
    node (per NVLink domain on multi-node NVLink: `EpPlacement.fabric_segments`). Capped by top_k (never more than
    the copies themselves)."""
    nodes = where.fabric_segments
    if nodes <= 1:
        return 0.0
    per_node = experts / nodes
    miss = 1.0
    for i in range(top_k):  # C(E - E_n, k) / C(E, k) as a product
        miss *= max(0.0, (experts - per_node - i)) / (experts - i)
    return min(float(top_k), (nodes - 1) * (1.0 - miss))

