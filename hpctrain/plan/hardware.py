"""Hardware catalog: GPUs, node profiles and fabrics, as data. Extendable from job.yaml.

Units are in the names. Bandwidths are per direction (what one send sees), in bytes/s. Peaks are
dense (no sparsity) tensor-core FLOP/s. Memory is what the driver reports as total (nvidia-smi
"MiB" column), which is what a process can at most allocate before the CUDA context.
Every figure cites its source: a vendor datasheet, a paper, a named measurement, or the calibration
fit of bench/planner_accuracy.py; the few without one say that they are assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from hpctrain.config import Job

GB = 1e9
TERA = 1e12
MIB = 2**20
GIB = 2**30


# GEMM efficiency is FITTED, not measured: the fraction of the dense peak that makes the cost model
# reproduce the calibration runs of bench/data/published_runs.yaml (PTD-P table 1 and llm-foundry's
# A100 rows; llm-foundry's H100 rows), chosen before any fit and fitted on nothing else:
# `python bench/planner_accuracy.py --fit` picks, per GPU, the value on a 0.01 grid that minimises the
# median |log(predicted / published)| of that GPU's calibration runs; the bench's summary lines give
# the error on both sets (the validation set is never read by the fit). It stands for everything
# the cost model has no term for (launch gaps, collectives sharing SMs with GEMMs, clocks below
# boost), so it sits below what cuBLAS reaches alone on large GEMMs (NVIDIA
# "Matrix Multiplication Background" user guide, section 2.3, tile sizes and performance). Re-fit
# when the cost model changes (A100: 0.66 before the pre-FlashAttention runs' score traffic had a
# term of its own, cost.SCORE_BYTES_*; 0.70 with it; 0.69 once each GEMM's reduction width sets
# its efficiency, kernels.linear_gemm_times; 0.70 again once a flash backward costs 2.5x its forward,
# kernels.FLASH_BACKWARD_WORK; 0.71 once the pipeline rank holding the head paces the step when it is the slower one,
# cost_setup.CostSetup.head_rank_layers). H200 has no run in the corpus: it shares H100's SMs, clocks and 700 W limit
# (H200 datasheet) and takes H100's figure.
A100_GEMM_EFFICIENCY = 0.71
H100_GEMM_EFFICIENCY = 0.57
# Attention efficiency from the kernels' own papers (not fitted): FlashAttention-2 reaches 50-73 % of
# the A100 peak (Dao 2023, arXiv 2307.08691, abstract; forward, backward lower, hence the low end) and
# "only 35 % utilization on the H100" (Shah et al. 2024, FlashAttention-3, abstract).
A100_ATTENTION_EFFICIENCY = 0.50
H100_ATTENTION_EFFICIENCY = 0.35
# Software stacks: what a published run's software reaches on the same GPU (bench/planner_accuracy.py's corpus
# field `stack`; hpctrain's own plans are always "torch"). "torch": PyTorch eager or compiled with SDPA's flash
# kernels (hpctrain's runtime, torchtitan, llm-foundry): the GPU's own figures above. "megatron-te": Megatron-Core
# with Transformer Engine. Its attention is cuDNN's fused attention, which on Hopper runs in FlashAttention-3's
# class: FlashAttention-3 is "1.5-2.0x faster than FlashAttention-2" forward and 1.5-1.75x backward, and cuDNN's
# kernels sit beside it in the same benchmarks (Shah et al. 2024, arXiv 2407.08608, abstract and figures 5-6);
# the backward is 2.5 of every 3.5 units of attention work (kernels.FLASH_BACKWARD_WORK), so 1.6x the FA2 figure,
# on Hopper only (wgmma/TMA are sm_90, hardware.py's L40S note). Its GEMM efficiency is FITTED like the others,
# on the calibration set's megatron-te rows only (`python bench/planner_accuracy.py --fit`), and kept per GPU;
# a GPU without a fitted figure keeps its own.
STACKS = ("torch", "megatron-te")
FA3_CLASS_ATTENTION_SPEEDUP = 1.6
# Transformer Engine's attention backend (its DotProductAttention picks one): "fused", cuDNN's fused attention, the
# FlashAttention-3 class above; "flash", the flash-attn package's FlashAttention-2 kernels, the GPU's own (FA2)
# figures. TE prefers "fused" on sm90 (transformer_engine/pytorch/attention.py from v1.4's "Select FusedAttention on
# sm90"); a run that sets NVTE_FUSED_ATTN=0 gets "flash". NeMo's launcher set it for every training job from 24.01
# through the 24.07 release ("Disable cudnn FA until we've tested it more": NVIDIA/NeMo-Framework-Launcher
# launcher_scripts/conf/config.yaml, 562dcb45 2024-02-13, in tags 24.01-24.07; removed by 04b8d098, 2024-08-29).
# Kernel figures that bear it out on Hopper (NVIDIA/cudnn-frontend benchmark/benchmark_results.csv at b740542,
# 2024-05-07, cuDNN 9.1, H200 at locked clocks, causal, head dim 128, 16K-64K tokens): cuDNN 520 TFLOP/s forward
# + backward, 0.53 of the 989 peak (the FA3 class: 0.35 x 1.6 = 0.56); PyTorch's FlashAttention-2 325, 0.33.
TE_ATTENTION_BACKENDS = ("fused", "flash")
HOPPER_GPUS = ("h100-80gb", "h100-96gb-500w", "h200-141gb")
# Blackwell takes H100's figures (the note below the catalog's efficiencies): for this stack too, its fitted GEMM
# figure and its attention class, the same assumption, until a Blackwell calibration run exists.
BLACKWELL_GPUS = ("b200-180gb", "b300-288gb", "gb200-186gb", "gb300-288gb")
# Fitted 2026-12-06 on the calibration set's megatron-te rows (NeMo 24.07's FP8 pre-training table, 12 rows on
# DGX-H100, each with its software: fused kernels, FP8, TE's TP overlap where its launcher set it, Megatron-Core's
# distributed optimizer): 0.81 (`--fit`; calibration FP8 7/12 within +-15 %, median 8.0 %); re-fitted the same day
# once the head's pipeline rank paces the step when slower (cost_setup.CostSetup.head_rank_layers): 0.83. Re-fitted
# 2026-12-07 once those rows run the attention their launcher set (TE_ATTENTION_BACKENDS: FlashAttention-2 for ten
# rows, cuDNN's for GPT-3 175B's two): the fit then ran to the grid's end (0.95), past what cuBLASLt alone runs FP8
# GEMMs at, and stopped at that ceiling (FP8_GEMM_MEASURED_TFLOPS): 0.87; re-fitted the same day once a collective
# across nodes spreads over its members' NICs in a node (comm.group_link; GPT-3 20B's DP over 4 members per node
# was 23 % too slow without): 0.80 (calibration FP8 9/12 within +-15 %, median 7.9 %). It prices TE's GEMMs with
# everything else that stack's runs lose and the cost model has no term for, as the other fitted figures do.
MEGATRON_TE_GEMM_EFFICIENCY: dict[str, float] = {"h100-80gb": 0.80}

# The power rule: one GPU's sustained tensor throughput at another power limit. Dense GEMMs run a GPU at its power
# limit; dynamic power goes as f x V^2 with the voltage tracking the clock, so the sustained clock scales as the cube
# root of the limit. Checked on Hopper: from H100 SXM's 989 TFLOPS at 700 W it gives 822 at the H100 NVL's 400 W,
# whose datasheet says 835 (1,671 with sparsity). A catalog GPU computes at the smaller of its datasheet figure and the
# rule's figure from the same GPU at the lowest power it ships at (its datasheet peak there): h100-96gb-500w from H100
# SXM (no datasheet for that power cap: the rule's figures are its peaks), gb200-186gb from B200 (its datasheet peaks
# kept for MFU, the rule's share of them in `Gpu.power_sustained`); the GPU's own note gives the figures.
POWER_SCALED_FROM = {"h100-96gb-500w": ("h100-80gb", 700, 500), "gb200-186gb": ("b200-180gb", 1000, 1200)}

# FP8 GEMMs measured side by side: the Azure AI-benchmarking-guide runs one cuBLASLt FP8 GEMM benchmark (random
# inputs, "best representation of real-life workloads", 10,000 warm-up iterations) on each of its VM types. On the
# four large shapes (M x N x K = 8192^3, 16384^3, 32768^3, 6144 x 12288 x 12288) ND GB200 v6 (CUDA 12.8;
# Azure_Results/ND_GB200_v6_results.md, stored version 2a370be6) reached 2,876.6 / 2,906.9 / 2,825.6 / 2,895.6
# TFLOPS and ND H100 v5 (CUDA 12.6; ND_H100_v5_results.md) 1,290.1 / 1,377.3 / 1,382.2 / 1,351.4: GB200 runs FP8
# GEMMs at 2.230 / 2.111 / 2.044 / 2.143, on average 2.132 x H100's, where the page's peaks say 2.53 and the power
# rule 2.42. (H100's own figure, 0.68-0.70 of its 1,979, is near what the cost model's fitted GEMM efficiency and
# FP8 ratio give it: 0.80 x 0.80 = 0.64 with Megatron-Core/TE.) So GB200's FP8 rate is that multiple of
# H100's, 0.844 of its page's 5,000 (`Gpu.fp8_sustained`), and B200's, the same silicon at 1,000 W, is GB200's
# under the power rule, (1,000 / 1,200)^(1/3) of it: 0.882 of its 4,500. bf16 has no such measurement and keeps
# the power rule. B300 / GB300 (Blackwell Ultra, other silicon) have none either.
# The same measurement bounds the calibration fit (bench/planner_accuracy.py --fit): a fitted GEMM efficiency prices
# the GEMMs with everything the cost model has no term for, so it may not make the GEMMs themselves faster than
# cuBLASLt alone runs them. The best of H100's large FP8 shapes, 1,382.2 TFLOPS (32768^3), caps the fit of a stack
# whose calibration runs are all FP8 at 1,382.2 / (1,979 x kernels.FP8_GEMM_EFFICIENCY_RATIO) = 0.873.
FP8_GEMM_MEASURED_TFLOPS = {"h100-80gb": 1382.2}
FP8_MEASURED_OVER_H100 = {"gb200-186gb": (2876.6 / 1290.1 + 2906.9 / 1377.3 + 2825.6 / 1382.2 + 2895.6 / 1351.4) / 4}
GB200_FP8_SUSTAINED_TFLOPS = FP8_MEASURED_OVER_H100["gb200-186gb"] * 1979  # x H100's page FP8: 4,219
_, _B200_WATTS, _GB200_WATTS = POWER_SCALED_FROM["gb200-186gb"]

# L40S (Ada, sm_89) has Ampere-style tensor cores driven by mma.sync; Hopper's wgmma and TMA, which
# the H100 figures reflect, are sm_90 only (PTX ISA, wgmma: "requires sm_90a"). No L40S training run
# is in the corpus, so it takes the A100 figures (FlashAttention-2 supports Ampere, Ada and Hopper,
# flash-attention README).
# V100 has no run in the corpus either: A100's GEMM figure; attention 0.35 because FlashAttention-2
# does not run on Volta (flash-attention README) and SDPA falls back to memory-efficient kernels.
# Blackwell (B200, B300, GB200, GB300) has no training run in the corpus either, so nothing can fit its
# figures: it takes H100's fitted GEMM figure and FlashAttention-3's H100 attention figure, an assumption.
# torchao's roofline table (torchao/testing/training/roofline_utils.py, 0.18) measured 82 % of the dense peak on
# large GEMMs of a B300 against the 78 % it measured on an H100, so the kernels reach as much of Blackwell Ultra's
# peak; GB200's FP8 GEMMs measured lower beside H100's (FP8_MEASURED_OVER_H100) and are priced at that measurement
# (`Gpu.fp8_sustained`). What the fitted figure stands for beyond the kernels (launch gaps, SMs shared with
# collectives, clocks) is not known for Blackwell. Re-fit once a Blackwell run is in the corpus.


@dataclass(frozen=True)
class Gpu:
    """One accelerator. `fp32_flops_per_s` is the plain (non-TF32) FP32 peak, used for precision fp32."""

    name: str
    memory_bytes: int
    bf16_flops_per_s: float  # 0 when the chip has no bf16 tensor cores
    fp16_flops_per_s: float
    fp32_flops_per_s: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, one direction; 0 = no NVLink (PCIe only)
    pcie_bytes_per_s: float  # host link, one direction
    # Achievable fractions of the dense peak (cost.py): 16-bit GEMMs of training shapes, and flash
    # attention forward + backward. Defaults: the A100 figures (above, with their sources).
    gemm_efficiency: float = A100_GEMM_EFFICIENCY
    attention_efficiency: float = A100_ATTENTION_EFFICIENCY
    fp8_flops_per_s: float = 0.0  # dense FP8 tensor-core peak; 0 = no FP8 tensor cores (train.precision: fp8)
    # Block-scaled (MX) FP8 tensor cores: the MMA reads one E8M0 scale per 32 elements of K itself (train.fp8.recipe
    # mxfp8); Blackwell's fifth-generation tensor cores (sm_100, PTX ISA "tcgen05.mma ... block_scale"), none before.
    mxfp8: bool = False
    # The share of the datasheet's tensor peaks the GPU sustains through dense GEMMs at its power limit, where the
    # power rule (POWER_SCALED_FROM) puts it below the datasheet: the cost model's compute runs at `rate_flops_per_s`;
    # MFU stays quoted against the datasheet's `peak_flops_per_s`, as publishers quote it.
    power_sustained: float = 1.0
    # The share of `fp8_flops_per_s` that FP8 GEMMs sustain, where a side-by-side measurement fixes it
    # (FP8_MEASURED_OVER_H100); 0: `power_sustained`, as the other tensor rates.
    fp8_sustained: float = 0.0

    def rate_flops_per_s(self, precision: str) -> float:
        """The dense peak the cost model computes at: `peak_flops_per_s` under the power limit (`power_sustained`, for
        the tensor cores; plain FP32 as the datasheet gives it)."""
        return self.peak_flops_per_s(precision) * (1.0 if precision == "fp32" else self.power_sustained)

    @property
    def fp8_rate_flops_per_s(self) -> float:
        """`fp8_flops_per_s` at what FP8 GEMMs sustain: the measured share (`fp8_sustained`) where there is one, else
        the power limit's (`power_sustained`)."""
        return self.fp8_flops_per_s * (self.fp8_sustained or self.power_sustained)

    def peak_flops_per_s(self, precision: str) -> float:
        """Dense peak for the job's compute precision.

        fp8 answers the bf16 peak: MFU is quoted against it (torchtitan's `get_peak_flops` does so for its
        float8 runs too), and the cost model's fp8 GEMM speed-up is not modelled here (the planner's
        precision dimension owns it); `fp8_flops_per_s` says whether the chip has FP8 at all."""
        return {"bf16": self.bf16_flops_per_s, "fp16": self.fp16_flops_per_s,
                "fp32": self.fp32_flops_per_s, "fp8": self.bf16_flops_per_s}[precision]


# PCIe host links: Gen3 x16 ~16 GB/s, Gen4 x16 ~32 GB/s, Gen5 x16 ~64 GB/s per direction (PCI-SIG).
GPUS: dict[str, Gpu] = {
    # NVIDIA Tesla V100 datasheet (SXM2 32GB): 125 TFLOPS tensor (fp16), 15.7 TFLOPS FP32, 900 GB/s
    # HBM2, NVLink 300 GB/s (bidirectional total); no bf16. nvidia-smi: 32768 MiB.
    "v100-32gb": Gpu("v100-32gb", 32768 * MIB, 0.0, 125 * TERA, 15.7 * TERA, 900 * GB, 150 * GB, 16 * GB,
                      gemm_efficiency=A100_GEMM_EFFICIENCY, attention_efficiency=0.35),
    # NVIDIA A100 datasheet (SXM): 312 TFLOPS bf16/fp16 dense, 19.5 TFLOPS FP32; 40GB: 1,555 GB/s,
    # 80GB: 2,039 GB/s HBM2e; NVLink 600 GB/s (bidirectional total). nvidia-smi: 40960 / 81920 MiB.
    "a100-40gb": Gpu("a100-40gb", 40960 * MIB, 312 * TERA, 312 * TERA, 19.5 * TERA, 1555 * GB, 300 * GB, 32 * GB,
                      gemm_efficiency=A100_GEMM_EFFICIENCY, attention_efficiency=A100_ATTENTION_EFFICIENCY),
    "a100-80gb": Gpu("a100-80gb", 81920 * MIB, 312 * TERA, 312 * TERA, 19.5 * TERA, 2039 * GB, 300 * GB, 32 * GB,
                      gemm_efficiency=A100_GEMM_EFFICIENCY, attention_efficiency=A100_ATTENTION_EFFICIENCY),
    # NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16/fp16 dense (1,979 with sparsity), 67 TFLOPS FP32,
    # 3.35 TB/s HBM3, NVLink 900 GB/s (bidirectional total). nvidia-smi: 81559 MiB.
    # FP8 (E4M3/E5M2) tensor cores: 1,979 TFLOPS dense (3,958 with sparsity), same datasheet.
    "h100-80gb": Gpu("h100-80gb", 81559 * MIB, 989 * TERA, 989 * TERA, 67 * TERA, 3350 * GB, 450 * GB, 64 * GB,
                      gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                      fp8_flops_per_s=1979 * TERA),
    # H100 SXM with 96 GB HBM2e at 2.4 TB/s run at a 500 W power limit: Meta's Grand Teton hosts, where
    # torchtitan's 2024-12 benchmarks ran (torchtitan benchmarks/llama3_h100_202412_torchtitan.md: "the actual
    # peak TFLOPs number is between SXM and NVL, and we don't know its exact value"). The peak is derived, not
    # fitted: dynamic power goes as f x V^2 with V tracking f, so a power cap scales the sustained tensor
    # clock by (cap / 700 W)^(1/3); at the H100 NVL's 400 W that gives 989 x 0.83 = 822 TFLOPS against its
    # datasheet's 835 (H100 NVL: 1,671 with sparsity), so at 500 W: 989 x 0.894 = 884 (FP8 1,769). Memory:
    # 96 GB scaled by the 80 GB part's MiB per GB (81559 / 80), an assumption (torchtitan's performance.md
    # calls the same hosts' GPUs "94GB"). Efficiencies as the H100's.
    "h100-96gb-500w": Gpu("h100-96gb-500w", 97871 * MIB, 884 * TERA, 884 * TERA, 60 * TERA, 2400 * GB, 450 * GB,
                          64 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                          fp8_flops_per_s=1769 * TERA),
    # NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16/fp16 dense, 67 TFLOPS FP32, 141 GB HBM3e at 4.8 TB/s,
    # NVLink 900 GB/s, FP8 1,979 TFLOPS dense. nvidia-smi: 143771 MiB.
    "h200-141gb": Gpu("h200-141gb", 143771 * MIB, 989 * TERA, 989 * TERA, 67 * TERA, 4800 * GB, 450 * GB, 64 * GB,
                       gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                       fp8_flops_per_s=1979 * TERA),
    # Blackwell (compute capability 10.x), two dies as one GPU. Peaks are the vendors' sparse figures halved
    # (NVIDIA's footnote on each table: "dense is one-half sparse"; GB200 computes at the power rule's share of them,
    # its note below); FP8 runs at twice bf16, and MX block-scaled
    # FP8 (mxfp8) at the FP8 rate (Blackwell architecture technical brief: block scaling in the tensor core).
    # NVLink 5: 18 links, 1.8 TB/s per GPU bidirectional, 900 GB/s per direction (DGX B200 datasheet: "14.4 TB/s
    # aggregate" over 8 GPUs; GB200 NVL72 page: 130 TB/s over 72). SM count 148 (device query in torchao PR #4002
    # for B200; the same 148 on a B300 SXM6 AC), used for NCCL's share of the SMs (comm.SM_COUNT).
    # B200 in DGX/HGX B200 (1,000 W): HGX B200 page, 8 GPUs: FP16/BF16 36 PFLOPS, FP8 72 PFLOPS (sparse), FP32
    # 600 TFLOPS -> 2,250 / 4,500 / 75 TFLOPS per GPU; torchao's roofline table holds the same 2,250 and 4,500.
    # Memory 180 GB (DGX B200 datasheet: 1,440 GB over 8); nvidia-smi: 183359 MiB. HBM: the datasheet's 8 TB/s
    # assumes an 8,192-bit bus, the CUDA 13 driver reports 7,680 bits at 3,996 MHz: 7.672 TB/s (torchao
    # roofline_utils.py, PR #4002), taken here. Host link PCIe Gen5 x16 (MLPerf Inference v6.0 system
    # descriptions of B200 nodes: "accelerator_host_interconnect: PCIe Gen5 x16"). FP8 GEMMs sustain GB200's measured
    # rate under the power rule, 3,970 TFLOPS (FP8_MEASURED_OVER_H100).
    "b200-180gb": Gpu("b200-180gb", 183359 * MIB, 2250 * TERA, 2250 * TERA, 75 * TERA, 7672 * GB, 900 * GB, 64 * GB,
                       gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                       fp8_flops_per_s=4500 * TERA, mxfp8=True,
                       fp8_sustained=GB200_FP8_SUSTAINED_TFLOPS * (_B200_WATTS / _GB200_WATTS) ** (1 / 3) / 4500),
    # B300 (Blackwell Ultra) in DGX/HGX B300: the Blackwell Ultra datasheet's 2,250 TFLOPS bf16 and 4,500 FP8
    # dense per GPU (torchao roofline_utils.py quotes it; the DGX B300 datasheet's "72 PFLOPS FP8 training" is the
    # sparse figure over 8), 288 GB HBM3e at 8 TB/s; nvidia-smi ("NVIDIA B300 SXM6 AC"): 275040 MiB. FP32: no
    # figure found for the HGX part, B200's 75 TFLOPS taken (an assumption; only precision fp32 uses it). Host
    # link: the GPU has PCIe Gen6, the DGX B300's Xeon 6 hosts PCIe Gen5: Gen5 x16 taken.
    "b300-288gb": Gpu("b300-288gb", 275040 * MIB, 2250 * TERA, 2250 * TERA, 75 * TERA, 8000 * GB, 900 * GB, 64 * GB,
                       gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                       fp8_flops_per_s=4500 * TERA, mxfp8=True),
    # The Blackwell GPU of a GB200 superchip (1,200 W): GB200 NVL72 page, 72 GPUs: FP16/BF16 360 PFLOPS and FP8
    # 720 PFLOPS (sparse), FP32 5,760 TFLOPS, 13.4 TB HBM3e at 576 TB/s, NVLink 130 TB/s -> per GPU 2,500 / 5,000
    # dense, 80 TFLOPS FP32, 186 GB at 8 TB/s, 1.8 TB/s NVLink. nvidia-smi ("NVIDIA GB200"): 189471 MiB. Host link:
    # NVLink-C2C, 900 GB/s bidirectional between one Grace CPU and its two GPUs (same page), taken as shared
    # evenly: 450 GB/s per direction over two GPUs, 225 GB/s each.
    # Sustained: the power rule's (POWER_SCALED_FROM), below the page's peaks. The GPU is B200's (the same two
    # Blackwell dies, 148 SMs) at 1,200 W, against B200's 1,000 W (MLPerf Inference v6.0 B200 system descriptions:
    # "B200 TGP 1000W"): 2,250 x (1,200 / 1,000)^(1/3) = 2,391 TFLOPS bf16 and 4,782 FP8, 0.9563 of the page's
    # 2,500 / 5,000 (`power_sustained`; MFU stays quoted against the page). Those would take (5,000 / 4,500)^3 x 1,000 W
    # = 1,372 W under the rule: a clock the 1,200 W limit does not sustain through dense GEMMs. The page's plain FP32
    # already sits on the rule (75 x 1.063 = 79.7 against its 80) and is kept. FP8 GEMMs: measured lower still,
    # 2.13 x H100's, 4,219 TFLOPS (FP8_MEASURED_OVER_H100, `fp8_sustained`).
    "gb200-186gb": Gpu("gb200-186gb", 189471 * MIB, 2500 * TERA, 2500 * TERA, 80 * TERA, 8000 * GB, 900 * GB,
                        225 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                        fp8_flops_per_s=5000 * TERA, mxfp8=True, power_sustained=2250 * 1.2 ** (1 / 3) / 2500,
                        fp8_sustained=GB200_FP8_SUSTAINED_TFLOPS / 5000),
    # The Blackwell Ultra GPU of a GB300 superchip (1,400 W): GB300 NVL72 page, 72 GPUs: FP16/BF16 360 PFLOPS and
    # FP8/FP6 720 PFLOPS (sparse), FP32 6 PFLOPS, up to 576 TB/s HBM3e, NVLink 130 TB/s -> per GPU 2,500 / 5,000
    # dense, 83 TFLOPS FP32, 8 TB/s, 1.8 TB/s NVLink; 288 GB (Blackwell Ultra datasheet); nvidia-smi ("NVIDIA
    # GB300"): 284208 MiB. Host link: NVLink-C2C from a Grace CPU to two GPUs as in GB200, 225 GB/s each.
    # Peaks: the page's, not capped by the power rule (POWER_SCALED_FROM): no source found fixes the power limit of
    # B300, the same Blackwell Ultra GPU at 4,500 FP8, in HGX systems (figures seen: B200's 1,000 W to 1,100 W), and
    # from those the rule gives 5,030 to 4,880 at 1,400 W, within 2.5 % of the page's 5,000.
    "gb300-288gb": Gpu("gb300-288gb", 284208 * MIB, 2500 * TERA, 2500 * TERA, 83 * TERA, 8000 * GB, 900 * GB,
                        225 * GB, gemm_efficiency=H100_GEMM_EFFICIENCY, attention_efficiency=H100_ATTENTION_EFFICIENCY,
                        fp8_flops_per_s=5000 * TERA, mxfp8=True),
    # NVIDIA L40S datasheet: 362.05 TFLOPS bf16/fp16 dense (733 with sparsity), 91.6 TFLOPS FP32,
    # 48 GB GDDR6 at 864 GB/s, no NVLink, PCIe Gen4 x16 64 GB/s (bidirectional), FP8 733 TFLOPS dense
    # (1,466 with sparsity; Ada's fourth-generation tensor cores). nvidia-smi: 46068 MiB.
    "l40s": Gpu("l40s", 46068 * MIB, 362.05 * TERA, 362.05 * TERA, 91.6 * TERA, 864 * GB, 0.0, 32 * GB,
                 gemm_efficiency=A100_GEMM_EFFICIENCY, attention_efficiency=A100_ATTENTION_EFFICIENCY,
                 fp8_flops_per_s=733 * TERA),
    # Not a GPU: one process of a local CPU run (executor local, gloo). Rough figures of a few
    # AVX2/AVX-512 cores per process and DDR4/5; "NVLink" stands for gloo's shared-memory transport
    # so that local TP is allowed. Only meant for planning test and tutorial runs: its efficiencies
    # are placeholders, neither measured nor fitted (no CPU run is in the corpus).
    "cpu": Gpu("cpu", 16 * GIB, 0.5 * TERA, 0.5 * TERA, 1.0 * TERA, 20 * GB, 10 * GB, 10 * GB,
               gemm_efficiency=0.5, attention_efficiency=0.3),
}


@dataclass(frozen=True)
class Fabric:
    """An inter-node network. `efficiency` is the bus-bandwidth fraction nccl-tests reach on it."""

    name: str
    nic_bytes_per_s: float  # one NIC, one direction
    latency_s: float  # one small message, end to end
    efficiency: float
    nccl_profile: str
    nics_per_node: int = 0  # without a node profile: NICs per node; 0 = one per GPU (HPC GPU nodes)


# Fabric efficiency: the fraction of line rate NCCL's bus bandwidth reaches on large messages.
# InfiniBand: "for NDR @ 400Gbps you should see 46-48GB/s per NIC" (NCCL maintainer, nccl-tests
# issue #290), 92-96 %; 4x HDR200 for 8 A100s peaks at 96 of 100 GB/s (nccl-tests issue #119);
# 0.90 leaves room for mid-size messages. RoCE and TCP: no measurement found in the sources searched;
# 0.80 (RoCE: the same NICs behind Ethernet congestion control) and 0.60 (NCCL's socket transport)
# are assumptions, and no calibration run isolates them (the corpus's RoCE runs are llm-foundry's,
# mostly single-node, and Llama 3's, in the validation set).
# Latency: one small message per ring step across the network. NCCL's own tuning model puts a NET
# ring step at 2.5 us (LL128) to 6.6 us (Simple) (src/graph/tuning.cc, hwLat); 5 us for IB is inside
# that range; RoCE 8 us and TCP 30 us are assumptions (switch buffering; kernel network stack).
FABRICS: dict[str, Fabric] = {
    # NVIDIA ConnectX-6 / Quantum HDR: 200 Gb/s per port (ConnectX-6 datasheet).
    "ib-hdr200": Fabric("ib-hdr200", 200e9 / 8, 5e-6, 0.90, "ib"),
    # NVIDIA ConnectX-7 / Quantum-2 NDR: 400 Gb/s per port (ConnectX-7 datasheet).
    "ib-ndr400": Fabric("ib-ndr400", 400e9 / 8, 5e-6, 0.90, "ib"),
    # NVIDIA ConnectX-8 SuperNIC / Quantum-X800 XDR: 800 Gb/s per port (ConnectX-8 datasheet; DGX B300 datasheet:
    # "8x OSFP ports serving 8x single-port NVIDIA ConnectX-8 VPI, up to 800Gb/s"; GB300 NVL72: one ConnectX-8 per
    # GPU). Efficiency and latency: NDR's (no nccl-tests figure at XDR found), an assumption.
    "ib-xdr800": Fabric("ib-xdr800", 800e9 / 8, 5e-6, 0.90, "ib"),
    # RoCE v2 over 200 GbE (ConnectX-6 Dx / Spectrum): same links, Ethernet congestion control.
    "roce": Fabric("roce", 200e9 / 8, 8e-6, 0.80, "roce", nics_per_node=2),
    # Plain TCP over 100 GbE through NCCL's socket transport.
    "ethernet": Fabric("ethernet", 100e9 / 8, 30e-6, 0.60, "ethernet", nics_per_node=1),
    # RoCE v2 at 400 Gb/s per GPU (one NIC each): Meta's Llama 3 training cluster (Dubey et al. 2024,
    # section 3.3.1: Arista 7800 / Minipack2 switches, 400 Gbps between GPUs); efficiency as "roce".
    "roce-400": Fabric("roce-400", 400e9 / 8, 8e-6, 0.80, "roce"),
    # Intel Omni-Path 100 Gb/s, four links per 8-GPU node: Jean Zay's A100 partition, where BLOOM
    # trained (BigScience 2022, arXiv 2211.05100, section 3.4.1); NCCL reaches it through verbs.
    # Efficiency and latency: no NCCL measurement on Omni-Path found; RoCE's assumptions.
    "omnipath-100": Fabric("omnipath-100", 100e9 / 8, 8e-6, 0.80, "ib", nics_per_node=4),
}


@dataclass(frozen=True)
class NodeProfile:
    """A server model: which GPUs, how many, which share an NVLink island, how many fabric NICs.

    A Slurm node is one operating-system instance: a DGX, or one compute tray of a rack whose NVLink switches join
    several trays into one NVLink domain (`nvlink_domain_gpus`, multi-node NVLink: GB200 / GB300 NVL72)."""

    name: str
    gpu: str
    gpus_per_node: int
    nvlink_island_gpus: int  # GPUs of one node that reach each other over NVLink/NVSwitch at full bandwidth
    nics_per_node: int
    fabric: str
    other_gpus: tuple[str, ...] = ()  # the same server model sold with another GPU variant
    nvlink_domain_gpus: int = 0  # GPUs joined by NVLink across nodes (a multiple of gpus_per_node); 0 = one node

    @property
    def gpus(self) -> tuple[str, ...]:
        return (self.gpu, *self.other_gpus)


NODES: dict[str, NodeProfile] = {
    # NVIDIA DGX A100 user guide: 8x A100 on 6 NVSwitches (one island), 8x HDR200 compute NICs; the
    # DGX A100 320GB system carries the 40 GB A100, the 640GB system the 80 GB one.
    "dgx-a100": NodeProfile("dgx-a100", "a100-80gb", 8, 8, 8, "ib-hdr200", other_gpus=("a100-40gb",)),
    # NVIDIA DGX H100 user guide: 8x H100 SXM on 4 NVSwitches, 8x NDR400 (ConnectX-7) compute NICs.
    "dgx-h100": NodeProfile("dgx-h100", "h100-80gb", 8, 8, 8, "ib-ndr400"),
    # Meta's Grand Teton (OCP 2022): 8x H100 fully connected with NVLink; torchtitan's benchmark hosts have a
    # backend RDMA network at 400 Gb/s per GPU (torchtitan benchmarks/llama3_h100_202412_torchtitan.md),
    # Meta's RoCE fabric (Dubey et al. 2024, section 3.3.1).
    "grand-teton-h100": NodeProfile("grand-teton-h100", "h100-96gb-500w", 8, 8, 8, "roce-400"),
    # NVIDIA HGX H200 reference board: 8x H200 SXM with NVSwitch; typically 8x NDR400 NICs.
    "hgx-h200": NodeProfile("hgx-h200", "h200-141gb", 8, 8, 8, "ib-ndr400"),
    # NVIDIA DGX B200 datasheet / user guide: 8x B200 on two NVSwitch chips (one island, 14.4 TB/s aggregate), 4x OSFP
    # ports serving 8x single-port ConnectX-7 VPI at up to 400 Gb/s InfiniBand for the compute fabric.
    "dgx-b200": NodeProfile("dgx-b200", "b200-180gb", 8, 8, 8, "ib-ndr400"),
    # NVIDIA DGX B300 datasheet: 8x B300 (Blackwell Ultra) on NVLink 5 switches, 8x OSFP ports serving 8x single-port
    # ConnectX-8 VPI at up to 800 Gb/s.
    "dgx-b300": NodeProfile("dgx-b300", "b300-288gb", 8, 8, 8, "ib-xdr800"),
    # NVIDIA GB200 NVL72: 18 compute trays of 2 GB200 superchips (4 GPUs, one Slurm node each) joined by 9 NVLink
    # switch trays into one NVLink domain of 72 GPUs at 1.8 TB/s per GPU (GB200 NVL72 page; DGX GB200 user guide);
    # each tray has 4 ConnectX-7 400 Gb/s NICs for the compute fabric, one per GPU (DGX GB200 user guide; MLPerf
    # system descriptions: 4 per 4-GPU node).
    "gb200-nvl72": NodeProfile("gb200-nvl72", "gb200-186gb", 4, 4, 4, "ib-ndr400", nvlink_domain_gpus=72),
    # NVIDIA GB300 NVL72: the same rack of 18 trays of 4 GPUs and one 72-GPU NVLink domain, one ConnectX-8 800 Gb/s
    # SuperNIC per GPU (GB300 NVL72 page: "72 ConnectX-8 SuperNICs").
    "gb300-nvl72": NodeProfile("gb300-nvl72", "gb300-288gb", 4, 4, 4, "ib-xdr800", nvlink_domain_gpus=72),
    # A PCIe server with 8x L40S (no NVLink: every GPU is its own island) and 2x 200 GbE RoCE NICs.
    "pcie-l40s": NodeProfile("pcie-l40s", "l40s", 8, 1, 2, "roce"),
    # NVIDIA DGX-1 with V100: hybrid cube mesh, fully connected quads (islands of 4), 4x EDR IB
    # (counted as HDR-class 100 Gb/s links would under-state nothing important here).
    "dgx1-v100": NodeProfile("dgx1-v100", "v100-32gb", 8, 4, 4, "ib-hdr200"),
}


@dataclass(frozen=True)
class Hardware:
    """What the planner needs to know about the cluster of one job, resolved from the catalog."""

    gpu: Gpu
    fabric: Fabric
    nodes: int
    gpus_per_node: int
    nvlink_island_gpus: int
    nics_per_node: int
    node_profile: Optional[str]
    # The NVLink domain: consecutive GPUs of the job (whole nodes, in Slurm's node order) that reach each other over
    # NVLink; 0 = one node's (every profile but the NVL72 racks). Groups inside one domain ride NVLink whether or not
    # they span nodes (comm.group_link, comm.ep_placement).
    nvlink_domain_gpus: int = 0
    # A collective that crosses nodes spreads its channels over the NICs of the members it has in a node (NCCL;
    # comm.group_link); False: one NIC per member, as a published run's software measured (bench only).
    nic_aggregation: bool = True

    def __post_init__(self) -> None:
        if not self.nvlink_domain_gpus:
            object.__setattr__(self, "nvlink_domain_gpus", self.gpus_per_node)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def multi_node_nvlink(self) -> bool:
        """NVLink joins more than one node's GPUs (GB200 / GB300 NVL72)."""
        return self.nvlink_domain_gpus > self.gpus_per_node

    @property
    def node_fabric_bytes_per_s(self) -> float:
        """Achievable inter-node injection bandwidth of one node, one direction."""
        return self.nics_per_node * self.fabric.nic_bytes_per_s * self.fabric.efficiency

    @property
    def intra_node_bytes_per_s(self) -> float:
        """GPU-to-GPU bandwidth inside an island: NVLink, or PCIe when there is none."""
        return self.gpu.nvlink_bytes_per_s or self.gpu.pcie_bytes_per_s


def with_stack(hw: Hardware, stack: str, gemm_efficiency: Optional[float] = None,
               te_attention: str = "fused") -> Hardware:
    """The hardware as a software stack (STACKS) runs it: megatron-te's attention (`te_attention`, one of
    TE_ATTENTION_BACKENDS) and fitted GEMM efficiency on the GPUs they are known for; `gemm_efficiency` overrides the
    GEMM figure (the calibration fit)."""
    if stack not in STACKS:
        raise ValueError(f"unknown software stack {stack!r}; known: {', '.join(STACKS)}")
    if te_attention not in TE_ATTENTION_BACKENDS:
        raise ValueError(f"unknown Transformer Engine attention backend {te_attention!r}; "
                         f"known: {', '.join(TE_ATTENTION_BACKENDS)}")
    gpu = hw.gpu
    if stack == "megatron-te" and gpu.name in HOPPER_GPUS + BLACKWELL_GPUS:
        fitted = MEGATRON_TE_GEMM_EFFICIENCY.get(
            gpu.name, MEGATRON_TE_GEMM_EFFICIENCY.get("h100-80gb") if gpu.name in BLACKWELL_GPUS else None)
        speedup = FA3_CLASS_ATTENTION_SPEEDUP if te_attention == "fused" else 1.0
        gpu = replace(gpu, attention_efficiency=gpu.attention_efficiency * speedup,
                      gemm_efficiency=fitted if fitted is not None else gpu.gemm_efficiency)
    if gemm_efficiency is not None:
        gpu = replace(gpu, gemm_efficiency=gemm_efficiency)
    return hw if gpu is hw.gpu else replace(hw, gpu=gpu)


def _lookup(table: dict[str, Any], name: str) -> Any:
    return table.get(name.lower())


def did_you_mean(name: str, known: list[str]) -> str:
    """' (did you mean 'x'?)' or '', for error messages."""
    import difflib  # only for an error message: validate of a valid job never loads it

    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_catalog_names(job: Job) -> list[str]:
    """Problems with the catalog names in job.cluster, one line each, with did-you-mean."""
    cluster, problems = job.cluster, []
    spec = getattr(cluster, "gpu_spec", None)
    checks: list[tuple[str, str, dict[str, Any], bool]] = [
        ("cluster.gpu", cluster.gpu, GPUS, spec is not None), ("cluster.fabric", cluster.fabric, FABRICS, False)]
    if cluster.node is not None:
        checks.append(("cluster.node", cluster.node, NODES, False))
    for path, name, table, custom in checks:
        if not custom and _lookup(table, name) is None:
            known = sorted(table)
            problems.append(f"{path}: unknown name (got {name!r}){did_you_mean(name, known)}; "
                            f"known: {', '.join(known)}")
    if cluster.node is not None and _lookup(NODES, cluster.node) is not None and spec is None:
        profile = _lookup(NODES, cluster.node)
        if _lookup(GPUS, cluster.gpu) is not None and cluster.gpu.lower() not in profile.gpus:
            problems.append(f"cluster.gpu: node profile {profile.name!r} has {' or '.join(profile.gpus)} GPUs "
                            f"(got {cluster.gpu!r}); set cluster.gpu={profile.gpu} or choose another cluster.node")
    profile = _lookup(NODES, cluster.node) if cluster.node is not None else None
    if profile is not None and cluster.gpus_per_node > profile.gpus_per_node:
        problems.append(f"cluster.gpus_per_node: node profile {profile.name!r} has {profile.gpus_per_node} GPUs per "
                        f"node (got {cluster.gpus_per_node}); set cluster.gpus_per_node={profile.gpus_per_node}")
    domain = getattr(cluster, "nvlink_domain_gpus", None)
    if domain is not None and domain % cluster.gpus_per_node:
        problems.append(f"cluster.nvlink_domain_gpus: an NVLink domain is whole nodes, a multiple of "
                        f"cluster.gpus_per_node={cluster.gpus_per_node} (got {domain}); set a multiple of it")
    return problems


def precision_problems(job: Job) -> list[str]:
    """train.precision: fp8 on a GPU type without FP8 tensor cores (V100, A100, the CPU...), or recipe mxfp8 on one
    without MX block-scaled ones (anything before Blackwell), unless emulated.

    The runtime checks the device each rank really has as well (runtime/distributed.py check_fp8_device)."""
    train = job.train
    if train.precision != "fp8" or train.fp8.emulate or check_catalog_names(job):
        return []
    gpu = resolve_hardware(job).gpu
    if gpu.fp8_flops_per_s <= 0:
        with_fp8 = ", ".join(name for name, g in GPUS.items() if g.fp8_flops_per_s > 0)
        return [f"train.precision: {gpu.name} has no FP8 tensor cores (got 'fp8'); use bf16 on it, a GPU with FP8 "
                f"({with_fp8}; or cluster.gpu_spec.fp8_peak_tflops), or train.fp8.emulate: true for tests and CPU "
                "checks (slower than bf16)"]
    if train.fp8.recipe == "mxfp8" and not gpu.mxfp8:
        with_mx = ", ".join(name for name, g in GPUS.items() if g.mxfp8)
        return [f"train.fp8.recipe: {gpu.name} has no MX block-scaled FP8 tensor cores (got 'mxfp8'); use tensorwise "
                f"or rowwise on it, a Blackwell GPU ({with_mx}; or cluster.gpu_spec.mxfp8: true), or "
                "train.fp8.emulate: true for tests and CPU checks"]
    return []


def resolve_hardware(job: Job, nvlink_island_gpus: Optional[int] = None) -> Hardware:
    """The job's hardware from the catalog, job.cluster.gpu_spec and an optional topology figure.

    Raises ValueError with the catalog problems (the caller turns it into a PlanError).
    """
    problems = check_catalog_names(job)
    if problems:
        raise ValueError("\n".join(problems))
    cluster = job.cluster
    # A GPU outside the catalog (cluster.gpu_spec gives peak, memory and NVLink): HBM and host link
    # as an A100-80GB's (datasheet: 2,039 GB/s, PCIe Gen4 x16), efficiencies the A100 defaults.
    gpu = _lookup(GPUS, cluster.gpu) or Gpu(cluster.gpu, 0, 0.0, 0.0, 0.0, 2000 * GB, 0.0, 32 * GB)
    spec = getattr(cluster, "gpu_spec", None)
    if spec is not None:
        peak = spec.peak_tflops * TERA
        gpu = replace(gpu, memory_bytes=int(spec.memory_gib * GIB), bf16_flops_per_s=peak, fp16_flops_per_s=peak,
                      # plain FP32 at 1/16 of the 16-bit tensor peak: the A100's ratio (312 / 19.5, datasheet)
                      fp32_flops_per_s=gpu.fp32_flops_per_s or peak / 16, nvlink_bytes_per_s=spec.nvlink_gbps * GB,
                      fp8_flops_per_s=spec.fp8_peak_tflops * TERA if spec.fp8_peak_tflops is not None
                      else gpu.fp8_flops_per_s, mxfp8=gpu.mxfp8 if spec.mxfp8 is None else spec.mxfp8,
                      power_sustained=1.0)  # the user's peak is taken as it is sustained
    profile = _lookup(NODES, cluster.node) if cluster.node else None
    fabric = _lookup(FABRICS, cluster.fabric)
    if nvlink_island_gpus is None:
        if profile is not None and profile.gpus_per_node == cluster.gpus_per_node:
            nvlink_island_gpus = profile.nvlink_island_gpus
        else:
            # Without a profile or a topology file: NVSwitch-class GPUs share one island per node.
            nvlink_island_gpus = cluster.gpus_per_node if gpu.nvlink_bytes_per_s > 0 else 1
    nics = profile.nics_per_node if profile is not None else (fabric.nics_per_node or cluster.gpus_per_node)
    return Hardware(gpu=gpu, fabric=fabric, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node,
                    nvlink_island_gpus=min(nvlink_island_gpus, cluster.gpus_per_node), nics_per_node=nics,
                    node_profile=profile.name if profile else None,
                    nvlink_domain_gpus=nvlink_domain_gpus(cluster, profile))


def nvlink_domain_gpus(cluster: Any, profile: Optional[NodeProfile]) -> int:
    """GPUs of the job per NVLink domain: cluster.nvlink_domain_gpus, else the profile's domain in nodes times the
    job's GPUs per node (a job on 2 GPUs of each NVL72 tray has domains of 18 x 2), else one node's."""
    given = getattr(cluster, "nvlink_domain_gpus", None)
    if given is not None:
        return int(given)
    if profile is not None and profile.nvlink_domain_gpus:
        return profile.nvlink_domain_gpus // profile.gpus_per_node * cluster.gpus_per_node
    return int(cluster.gpus_per_node)
