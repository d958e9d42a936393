"""FP8 GEMMs and torch.compile in the cost model (issue 26 item 2): eligible linears at the FP8 peak with their
casts, the head/router/routed experts in 16 bits, compile's fusion of element-wise passes. Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.plan import kernels, plan_job
from hpctrain.plan.hardware import resolve_hardware


def _hw():
    return resolve_hardware(job_from_dict({"name": "h", "model": {"preset": "tiny"}, "cluster": {
        "nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}}))


def _linear_speedup(m: int, k: int, n: int) -> float:
    hw = _hw()
    hbm = hw.gpu.hbm_bytes_per_s * kernels.HBM_EFFICIENCY
    bf16 = hw.gpu.bf16_flops_per_s * hw.gpu.gemm_efficiency
    fp8 = hw.gpu.fp8_flops_per_s * hw.gpu.gemm_efficiency * kernels.FP8_GEMM_EFFICIENCY_RATIO
    casts = kernels.FP8_CAST_BYTES_COMPILED * (k + n + k * n / m) / hbm
    return sum(kernels.gemm_times([(k, n)], m, bf16)) / (sum(kernels.gemm_times([(k, n)], m, fp8)) + casts)


@pytest.mark.parametrize("m,k,n,published", [(4096, 8192, 16384, 1.39), (1024, 2048, 1024, 0.80)])
def test_the_calibration_microbenchmarks(m, k, n, published):
    # torchao float8 README, "Performance": forward + backward of one linear on H100 (the fit's source)
    assert _linear_speedup(m, k, n) == pytest.approx(published, rel=0.05)


def _job(precision="bf16", compile_=False, tp=1, model=None, **train):
    return job_from_dict({
        "name": "f", "model": model or {"preset": "llama3-8b"},
        "train": {"global_batch": 8, "micro_batch": 1, "activation_checkpointing": "selective",
                  "precision": precision, "compile": compile_, **train},
        "parallel": {"tp": tp, "pp": 1, "dp": 8 // tp, "zero": 3, "sequence_parallel": tp > 1},
        "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}})


def _tokens(job) -> float:
    return plan_job(job).best.cost.tokens_per_s


def test_fp8_speeds_up_wide_linears_and_not_narrow_ones():
    bf16, fp8 = _tokens(_job()), _tokens(_job("fp8"))
    assert 1.05 < fp8 / bf16 < 1.6  # torchao's e2e speed-ups are 1.25-1.5x (validation, not asserted tightly)
    # min_width above every linear: nothing converts, the step is the bf16 one
    assert _tokens(_job("fp8", fp8={"min_width": 16384})) == pytest.approx(bf16)
    # emulation computes in 16/32 bits: no fp8 speed-up is priced
    assert _tokens(_job("fp8", fp8={"emulate": True})) == pytest.approx(bf16)


def test_fp8_casts_cost_more_unfused():
    hw = _hw()
    job = _job("fp8")
    eager = kernels.fp8_linears_s(job.model, hw, 1, 8192, 1024, compiled=False)
    compiled = kernels.fp8_linears_s(job.model, hw, 1, 8192, 1024, compiled=True)
    assert eager > compiled
    assert compiled < 0  # fp8 saves time on Llama 3 8B's linears


def test_fp8_leaves_routed_experts_in_16_bits():
    hw = _hw()
    moe = job_from_dict({"name": "m", "model": {"preset": "qwen3-30b-a3b", "seq_len": 4096}}).model
    attention_only = kernels.fp8_linears_s(moe, hw, 1, 4096, 1024, compiled=True)
    dense = job_from_dict({"name": "d", "model": {"preset": "qwen3-30b-a3b", "seq_len": 4096, "moe": None}}).model
    with_ffn = kernels.fp8_linears_s(dense, hw, 1, 4096, 1024, compiled=True)
    assert attention_only < 0 and with_ffn < attention_only  # the dense FFN converts, the experts do not


def test_compile_fuses_element_wise_passes_where_the_runtime_compiles():
    eager, compiled = _tokens(_job()), _tokens(_job(compile_=True))
    assert compiled > eager
    # tensor-parallel blocks are not compiled by the runtime (resolve_job turns compile off): no saving there
    def by_label(compile_):
        job = _job(compile_=compile_)
        job = job.model_copy(update={"parallel": job.parallel.model_copy(update={"tp": "auto", "dp": "auto",
                                                                                "sequence_parallel": True})})
        return {lay.label(): lay.cost.tokens_per_s for lay in plan_job(job).layouts}
    on, off = by_label(True), by_label(False)
    tp2 = [label for label in on if label.startswith("tp=2 ")]
    tp1 = [label for label in on if label.startswith("tp=1 ")]
    assert tp2 and tp1
    assert all(on[label] == pytest.approx(off[label]) for label in tp2)
    assert all(on[label] > off[label] for label in tp1)
