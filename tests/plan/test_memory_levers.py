"""Issue 27 on the login path: fp8 refused where the GPU type has no FP8, the memory levers' one-line
refusals, and what the planner counts for them (the host embedding's saving and transfer, the math kernel's
materialised scores). Torch-free, like the stages it tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpctrain.cli import main
from hpctrain.plan.cost import embedding_transfer_s, step_cost
from hpctrain.plan.cost_setup import CostSetup
from hpctrain.plan.hardware import GPUS, TERA
from hpctrain.plan.memory import peak_rank_memory
from hpctrain.plan.rank_setup import RankSetup
from hpctrain.plan.model_stats import embedding_param_count
from hpctrain.plan.stages import balanced_stage_split

from .shapes import LLAMA3_8B

JOB = """\
name: levers
model:
  preset: tiny
train:
  global_batch: 8
  micro_batch: 2
parallel:
  tp: 1
  pp: 1
  dp: 2
cluster:
  executor: local
  nodes: 1
  gpus_per_node: 2
  gpu: {gpu}
"""


def _validate(tmp_path: Path, capsys: Any, gpu: str, *overrides: str) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(gpu=gpu), encoding="utf-8")
    code = main(["validate", str(path), *(f"--set={o}" for o in overrides)])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("gpu", ["a100-80gb", "v100-32gb", "cpu"])
def test_fp8_is_refused_where_the_gpu_type_has_no_fp8(tmp_path, capsys, gpu) -> None:
    code, out = _validate(tmp_path, capsys, gpu, "train.precision=fp8")
    assert code == 2
    lines = [line for line in out.splitlines() if "train.precision" in line]
    assert len(lines) == 1 and f"train.precision: {gpu} has no FP8 tensor cores (got 'fp8')" in lines[0]
    assert "train.fp8.emulate: true" in lines[0] and "Traceback" not in out
    assert _validate(tmp_path, capsys, gpu, "train.precision=fp8", "train.fp8.emulate=true")[0] == 0


@pytest.mark.parametrize("gpu", ["h100-80gb", "h200-141gb", "l40s"])
def test_fp8_is_accepted_on_gpus_with_fp8(tmp_path, capsys, gpu) -> None:
    code, out = _validate(tmp_path, capsys, gpu, "train.precision=fp8")
    assert code == 0, out
    assert GPUS[gpu].fp8_flops_per_s >= 700 * TERA


def test_gpu_spec_can_declare_fp8(tmp_path, capsys) -> None:
    spec = "cluster.gpu_spec={memory_gib: 80, peak_tflops: 900, fp8_peak_tflops: 1800}"
    assert _validate(tmp_path, capsys, "mychip", "train.precision=fp8", spec)[0] == 0
    spec = "cluster.gpu_spec={memory_gib: 80, peak_tflops: 900}"
    assert _validate(tmp_path, capsys, "mychip", "train.precision=fp8", spec)[0] == 2


@pytest.mark.parametrize("overrides, want", [
    (["train.embedding_on_cpu=true", "parallel.tp=2", "parallel.dp=1"],
     "train.embedding_on_cpu: does not combine with tensor parallel (parallel.tp=2)"),
    (["train.embedding_on_cpu=true", "model.tie_embeddings=true"],
     "train.embedding_on_cpu: does not combine with model.tie_embeddings"),
    (["train.attention_kernel=efficient"], "train.attention_kernel: torch has no memory-efficient SDPA kernel for the CPU"),
    (["train.attention_kernel=fastest"], "train.attention_kernel"),
])
def test_memory_levers_refusals_are_one_line(tmp_path, capsys, overrides, want) -> None:
    code, out = _validate(tmp_path, capsys, "cpu", *overrides)
    assert code == 2 and "Traceback" not in out
    assert sum(want in line for line in out.splitlines()) == 1, out


def _setup(**kw: Any) -> RankSetup:
    base: dict[str, Any] = dict(tp=1, pp=1, dp=1, micro_batch=1, micro_batches=1, schedule="none", virtual_stages=1,
                                ac="none", zero=0, offload_optimizer=False, sequence_parallel=False, precision="bf16",
                                optimizer="adamw", overhead_bytes=0.0)
    base.update(kw)
    return RankSetup(**base)


def _memory(model: Any, **kw: Any) -> Any:
    s = _setup(**kw)
    return peak_rank_memory(model, balanced_stage_split(model, s.pp, s.virtual_stages), s)[1]


@pytest.mark.parametrize("layout", [dict(), dict(dp=8, zero=1, micro_batch=2), dict(dp=8, zero=3, micro_batch=2),
                                    dict(dp=4, zero=2, micro_batch=1, micro_batches=2)])
def test_host_embedding_saves_its_weights_grads_and_states(layout) -> None:
    on_device, on_host = _memory(LLAMA3_8B, **layout), _memory(LLAMA3_8B, embedding_on_cpu=True, **layout)
    table = embedding_param_count(LLAMA3_8B)
    shard = layout.get("dp", 1)
    assert on_device.optimizer - on_host.optimizer == pytest.approx(8 * table / shard)  # AdamW's two moments
    saved = on_device.total - on_host.total
    # At least the fp32 master weights, the optimizer states and (at the optimizer step) the fp32 gradients;
    # the peak may move to another moment, never to one costing more than before.
    assert saved >= (4 + 8) * table / shard * 0.999
    assert saved > 0


def test_host_embedding_costs_its_transfers() -> None:
    hw_setup = dict(tp=1, pp=1, dp=8, micro_batch=1, micro_batches=4, virtual_stages=1, ac="none", zero=1,
                    offload_optimizer=False, precision="bf16", max_rank_layers=32, max_rank_has_head=True,
                    rank_params=8e9)
    from hpctrain.plan.hardware import Hardware, FABRICS

    hw = Hardware(gpu=GPUS["h100-80gb"], fabric=FABRICS["ib-ndr400"], nodes=1, gpus_per_node=8,
                  nvlink_island_gpus=8, nics_per_node=8, node_profile=None)
    base = step_cost(LLAMA3_8B, hw, CostSetup(**hw_setup), 64)
    host = step_cost(LLAMA3_8B, hw, CostSetup(**hw_setup, embedding_on_cpu=True), 64)
    per_micro_batch = embedding_transfer_s(LLAMA3_8B, hw, LLAMA3_8B.seq_len, 2)
    # [8192 tokens, 4096] in bf16 each way over a 64 GB/s host link: about 2 ms per micro-batch
    assert per_micro_batch == pytest.approx(2 * 8192 * 4096 * 2 / 64e9)
    assert host.step_time_s - base.step_time_s == pytest.approx(4 * per_micro_batch, rel=0.05)


def test_math_kernel_is_the_materialized_cost(tmp_path) -> None:
    from hpctrain.config import job_from_dict
    from hpctrain.plan.planner import planned_attention, planned_precision

    def job(**train: Any) -> Any:
        return job_from_dict({"name": "x", "model": {"preset": "tiny"}, "train": train,
                              "cluster": {"gpu": "h100-80gb", "gpus_per_node": 1}})

    assert planned_attention(job(attention_kernel="math")) == "materialized"
    assert {planned_attention(job(attention_kernel=k)) for k in ("auto", "flash", "efficient")} == {"flash"}
    assert planned_precision(job(precision="fp8")) == "bf16"
    assert planned_precision(job(precision="fp8", fp8={"high_precision": "fp32"})) == "fp32"
    flash = _memory(LLAMA3_8B, attention="flash")
    math = _memory(LLAMA3_8B, attention="materialized")
    assert math.activations > flash.activations
