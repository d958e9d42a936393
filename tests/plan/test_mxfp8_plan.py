"""train.fp8.recipe mxfp8 at validate and plan (issue 26): accepted, refused in one line on GPUs without MX
block-scaled tensor cores unless emulated, and priced as GEMMs at the FP8 peak with one fused cast per tensor
layout (the block amax inside the cast, 1/32 of a scale byte per element). Torch-free."""

from __future__ import annotations

import pytest

from hpctrain.config import job_from_dict
from hpctrain.config.job import cross_field_problems
from hpctrain.errors import ConfigError, PlanError
from hpctrain.plan import kernels, plan_job
from hpctrain.plan.hardware import precision_problems, resolve_hardware

B200 = {"nodes": 1, "gpus_per_node": 8, "gpu": "b200-180gb", "node": "dgx-b200", "fabric": "ib-ndr400"}
H100 = {"nodes": 1, "gpus_per_node": 8, "gpu": "h100-80gb", "node": "dgx-h100", "fabric": "ib-ndr400"}


def _job(cluster=B200, model=None, parallel=None, micro_batch=1, **fp8):
    return job_from_dict({
        "name": "mx", "model": model or {"preset": "llama3-8b"},
        "train": {"global_batch": 8, "micro_batch": micro_batch, "activation_checkpointing": "selective",
                  "precision": "fp8", "fp8": {"recipe": "mxfp8", **fp8}},
        "parallel": parallel or {"tp": 1, "pp": 1, "dp": 8, "zero": 3},
        "cluster": cluster})


def test_mxfp8_is_refused_before_blackwell_unless_emulated():
    assert precision_problems(_job()) == []
    assert precision_problems(_job(H100)) == [
        "train.fp8.recipe: h100-80gb has no MX block-scaled FP8 tensor cores (got 'mxfp8'); use tensorwise or "
        "rowwise on it, a Blackwell GPU (b200-180gb, b300-288gb, gb200-186gb, gb300-288gb; or "
        "cluster.gpu_spec.mxfp8: true), or train.fp8.emulate: true for tests and CPU checks"]
    assert precision_problems(_job(H100, emulate=True)) == []
    with pytest.raises(PlanError, match="no MX block-scaled FP8 tensor cores"):
        plan_job(_job(H100))
    custom = {**H100, "gpu_spec": {"memory_gib": 80, "peak_tflops": 989, "fp8_peak_tflops": 1979, "mxfp8": True}}
    assert precision_problems(_job(custom)) == []
    tensorwise = _job(H100)
    tensorwise = tensorwise.model_copy(update={"train": tensorwise.train.model_copy(update={
        "fp8": tensorwise.train.fp8.model_copy(update={"recipe": "tensorwise"})})})
    assert precision_problems(tensorwise) == []


def test_mxfp8_needs_whole_blocks_of_tokens_per_rank():
    with pytest.raises(ConfigError) as refused:
        _job(model={"preset": "llama3-8b", "seq_len": 1000})
    assert refused.value.problems == [
        "<dict>:1: train.fp8.recipe: mxfp8 scales blocks of 32 along every GEMM's reduction, the weight gradient's "
        "over a micro-batch's tokens on a rank (train.micro_batch x model.seq_len / parallel.cp = 1000) (got "
        "'mxfp8'); make that a multiple of 32 (model.seq_len, or a fixed train.micro_batch), or use recipe "
        "tensorwise"]
    assert cross_field_problems(_job(model={"preset": "llama3-8b", "seq_len": 16}, micro_batch=2,
                                     parallel={"tp": 2, "pp": 1, "dp": 4, "zero": 3})) == []  # 2 x 16 tokens
    assert cross_field_problems(_job()) == []
    cp = _job(model={"preset": "llama3-8b", "seq_len": 8192},
              parallel={"tp": 1, "pp": 1, "dp": 2, "cp": 4, "zero": 3})
    assert cross_field_problems(cp) == []  # 2048 tokens per cp rank


def test_mx_casts_fuse_the_amax_and_add_a_scale_byte_per_block():
    assert kernels.FP8_MX_CAST_BYTES == pytest.approx(2 * (2 + 1 + 1 / 32))  # 6.0625: two layouts, no amax pass
    job = _job()
    hw = resolve_hardware(job)
    model, tokens = job.model, 8192
    mx = kernels.fp8_linears_s(model, hw, 1, tokens, 1024, compiled=False, recipe="mxfp8")
    tensorwise = kernels.fp8_linears_s(model, hw, 1, tokens, 1024, compiled=True)
    # the same GEMMs at the FP8 peak; only the casts differ: 6.0625 bytes per element against 8 compiled
    linears = kernels.layer_linears(model, 1)
    hbm = hw.gpu.hbm_bytes_per_s * kernels.HBM_EFFICIENCY
    elements = sum(i + o + i * o / tokens for i, o in linears)
    assert tensorwise - mx == pytest.approx((8.0 - kernels.FP8_MX_CAST_BYTES) * elements / hbm)
    assert mx < 0  # a net saving on Llama 3 8B's linears


def test_mx_blocks_stay_inside_a_tp_shard():
    hw = resolve_hardware(_job())

    def mx(ffn: int, tp: int) -> float:
        model = job_from_dict({"name": "m", "model": {"preset": "llama3-8b", "ffn_hidden": ffn}}).model
        return kernels.fp8_linears_s(model, hw, tp, 8192, 1024, compiled=True, recipe="mxfp8")

    # 14352 = 16 x 897: no whole MX blocks, attention alone converts; 14368 = 32 x 449: whole blocks on one rank,
    # not on each of two (a block would straddle the tp shards); 14336 = 64 x 224: on each of two as well
    assert mx(14368, 1) < mx(14352, 1)
    assert mx(14368, 2) == mx(14352, 2)
    assert mx(14336, 2) < mx(14368, 2)


def test_plan_prices_mxfp8_on_b200():
    bf16 = job_from_dict({**_job().model_dump(mode="json", exclude={"placement"}),
                          "train": {"global_batch": 8, "micro_batch": 1, "activation_checkpointing": "selective"}})
    mx, tensorwise = plan_job(_job()).best.cost, plan_job(_job(recipe="tensorwise")).best.cost
    plain = plan_job(bf16).best.cost
    # eager tensorwise pays unfused casts (16 bytes per element), mxfp8's casts are fused kernels compiled or not:
    # the same layout (all fixed), one micro-batch of seq_len tokens, the difference is the casts' bytes alone
    assert plain.tokens_per_s < tensorwise.tokens_per_s < mx.tokens_per_s
    model, hw = _job().model, resolve_hardware(_job())
    tokens = model.seq_len
    elements = sum(i + o + i * o / tokens for i, o in kernels.layer_linears(model, 1))
    assert tensorwise.compute_s - mx.compute_s == pytest.approx(
        tokens * model.layers * (kernels.FP8_CAST_BYTES_EAGER - kernels.FP8_MX_CAST_BYTES) * elements
        / (hw.gpu.hbm_bytes_per_s * kernels.HBM_EFFICIENCY), rel=1e-9)
    assert plan_job(_job(emulate=True)).best.cost.tokens_per_s == pytest.approx(plain.tokens_per_s)
