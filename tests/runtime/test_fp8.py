"""FP8 training with torchao's float8 linears, emulated on the CPU (issue 27 item 1).

- A tp2 x dp2 layout (FSDP2 with fp8 all-gather, torchao's float8 TP styles) trains like one process
  (losses <= 1e-5, the same state-dict names: checkpoints keep the ordinary weights), for both recipes, and
  so does pp2 x dp2 with selective activation checkpointing;
  in the same 4-process group train.embedding_on_cpu over dp4 trains like the on-device single process.
- Against bf16 on real text, the fp8 loss stays within 2 % at every one of 100 steps.
- A crash and a resume under dp2 (fp8 all-gather) reproduce the uninterrupted run bit for bit, and the
  checkpoint loads into a job without fp8 (it holds the ordinary fp32 weights).
- Without emulation, the runtime refuses fp8 on the CPU before any step (exit 2, the reason in one line).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch

pytest.importorskip("torchao.float8")

from hpctrain.runtime.parallel.build import build_training  # noqa: E402

from ._dist import run_distributed  # noqa: E402
from ._entry import copy_run, events, losses, make_job, metrics, run_entry  # noqa: E402
from ._jobs import global_batch, tiny_job  # noqa: E402
from .test_parallel_parity import _check_layout, run_group, train_layout_single  # noqa: E402

# min_width 16: the tiny model's linears (32 and 64 wide) are converted; fp32 around them, so that a layout's
# only differences are the fp8 casts' (exact given equal scales) and fp32 summation order.
FP8 = {"precision": "fp8", "fp8": {"emulate": True, "min_width": 16, "high_precision": "fp32"}}
ROWWISE = {"precision": "fp8", "fp8": {"emulate": True, "min_width": 16, "high_precision": "fp32", "recipe": "rowwise"}}

LAYOUTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (name, layout, the single-process reference's train fields)
    ("fp8 tensorwise tp2 dp2 zero3", dict(tp=2, dp=2, zero=3, micro_batch=2, train=FP8), FP8),
    ("fp8 rowwise tp2 dp2 zero1 sp", dict(tp=2, dp=2, zero=1, micro_batch=1, sequence_parallel=True, train=ROWWISE),
     ROWWISE),
    ("fp8 tensorwise pp2 dp2 1f1b zero2 ac-selective", dict(pp=2, dp=2, zero=2, micro_batch=1, ac="selective",
                                                            train=FP8), FP8),
    ("embedding on cpu dp4 zero2", dict(dp=4, zero=2, micro_batch=1, train={"embedding_on_cpu": True}), {}),
]


@pytest.mark.dist
def test_fp8_and_host_embedding_layouts_match_one_process() -> None:
    start = time.monotonic()
    results = run_distributed(run_group, 4, [kw for _, kw, _ in LAYOUTS], timeout_s=300)
    for i, (name, kwargs, ref_train) in enumerate(LAYOUTS):
        ranks = [per_rank[i] for per_rank in results]
        # The reference runs the layout's micro-batches: tensorwise scales come from a whole micro-batch's
        # activations (and output gradients), so one process must cast the same sequences together (dp rank r's
        # micro-batches are the single process's micro-batches r*m .. r*m+m-1: the same groups).
        reference = train_layout_single(dict(micro_batch=kwargs["micro_batch"], train=ref_train))
        diffs = _check_layout(name, ranks, reference)
        print(f"[fp8] {name}: max|dloss|={diffs['loss']:.2e} max|dparam|={diffs['param']:.2e}")
    print(f"[fp8] {len(LAYOUTS)} layouts on 4 ranks in {time.monotonic() - start:.1f} s")


def test_only_eligible_linears_are_converted() -> None:
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from hpctrain.runtime.parallel.float8 import eligible

    keep = eligible(64)
    assert keep(nn.Linear(64, 128, device="meta"), "layers.0.attention.wq")
    assert not keep(nn.Linear(64, 128, device="meta"), "output")  # the head
    assert not keep(nn.Linear(64, 128, device="meta"), "layers.3.feed_forward.router.gate")  # the MoE router
    assert not keep(nn.Linear(32, 128, device="meta"), "layers.0.attention.wq")  # narrower than min_width
    assert not keep(nn.Linear(72, 136, device="meta"), "layers.0.attention.wq")  # not a multiple of 16
    training = build_training(tiny_job(train=FP8), torch.device("cpu"))
    part = training.model_parts[0]
    converted = sorted(name for name, m in part.named_modules() if isinstance(m, Float8Linear))
    assert len(converted) == 4 * 7 and "output" not in converted  # wq wk wv wo w1 w2 w3 of 4 layers
    assert all(p.dtype == torch.float32 for p in training.parameters())  # master weights stay fp32
    narrow = build_training(tiny_job(train={**FP8, "fp8": {**FP8["fp8"], "min_width": 64}}), torch.device("cpu"))
    assert not any(isinstance(m, Float8Linear) for m in narrow.model_parts[0].modules())  # hidden 32 < 64


def test_lora_base_runs_in_fp8() -> None:
    from torchao.float8.float8_linear import Float8Linear

    job = tiny_job(optimizer="adamw", lr=1e-2, train={**FP8, "lora": {"rank": 4}})
    training = build_training(job, torch.device("cpu"))
    wq = training.model_parts[0].layers["0"].attention.wq  # type: ignore[union-attr]
    assert isinstance(wq, Float8Linear) and not wq.weight.requires_grad and wq.lora_A.requires_grad
    optimizer = torch.optim.AdamW(training.parameters(), lr=1e-2)
    inputs, labels = global_batch(0)
    got = []
    for _ in range(4):
        optimizer.zero_grad()
        got.append(training.train_step(inputs, labels))
        training.optimizer_step(optimizer)
    assert got[-1] < got[0]


REAL_TEXT_STEPS = 100


def _real_text_job(tokens: str, **train: Any) -> dict:
    # ffn_hidden 192 (a multiple of 16): the MLP's linears are converted too, not only attention's. lr 1e-3: at
    # 3e-3 this tiny model's trajectory is chaotic enough that bf16 and fp32 already part by 6 % at some step
    # (measured), which would say nothing about fp8; at 1e-3 bf16 vs fp8 stayed within 0.75 % (tensorwise).
    return make_job(model={"preset": "tiny", "layers": 2, "seq_len": 64, "ffn_hidden": 192},
                    train={"global_batch": 8, "micro_batch": 8, "steps": REAL_TEXT_STEPS, "data": tokens,
                           "optimizer": {"lr": 0.001, "weight_decay": 0.0}, "lr_schedule": {"warmup_steps": 5},
                           **train},
                    checkpoint={"every_steps": 1000, "keep_last": 1, "final": False})


@pytest.mark.slow
def test_fp8_follows_bf16_on_real_text(tokens, tmp_path) -> None:
    bf16, fp8 = str(tmp_path / "bf16"), str(tmp_path / "fp8")
    assert run_entry(_real_text_job(tokens, precision="bf16"), bf16) == [0]
    fp8_train = {"precision": "fp8", "fp8": {"emulate": True, "min_width": 16}}  # bf16 around the fp8 GEMMs
    assert run_entry(_real_text_job(tokens, **fp8_train), fp8) == [0]
    want, got = losses(bf16), losses(fp8)
    assert len(want) == len(got) == REAL_TEXT_STEPS
    worst = max(abs(a - b) / a for a, b in zip(want, got))
    print(f"[fp8] real text, {REAL_TEXT_STEPS} steps: loss {want[0]:.3f} -> {want[-1]:.3f} (bf16), "
          f"{got[0]:.3f} -> {got[-1]:.3f} (fp8); worst relative gap {worst:.2%}")
    assert worst <= 0.02
    assert want[-1] < want[0] - 2.0  # it learned: the comparison is over a falling curve
    assert {m["fp8_recipe"] for m in metrics(fp8)} == {"tensorwise (emulated)"}


def test_fp8_resume_is_bit_identical(tmp_path) -> None:
    """dp2 with fp8 all-gather (the weights are torchao subclasses inside FSDP's DTensors): 6 steps, then a
    'crash' after step 5 with the last checkpoint at 3; the restart reproduces steps 4-6 exactly."""
    job = make_job(dp=2, train={**FP8, "micro_batch": 1, "optimizer": {"lr": 0.003}})
    full = str(tmp_path / "full")
    assert run_entry(job, full) == [0, 0]
    crashed = copy_run(full, str(tmp_path / "crashed"))
    shutil.rmtree(os.path.join(crashed, "checkpoints", "step-6"))
    with open(os.path.join(crashed, "metrics.jsonl")) as handle:
        lines = handle.readlines()
    with open(os.path.join(crashed, "metrics.jsonl"), "w") as handle:
        handle.writelines(lines[:5])
    assert run_entry(job, crashed) == [0, 0]
    assert [e["step"] for e in events(crashed) if e["event"] == "resumed"] == [3]
    a, b = metrics(full), metrics(crashed)
    assert [(m["step"], m["loss"], m["grad_norm"]) for m in b] == [(m["step"], m["loss"], m["grad_norm"]) for m in a]
    # The checkpoint holds the ordinary fp32 weights (not torchao's subclass): a plain job resumes from it.
    plain = str(tmp_path / "plain")
    step3 = os.path.join(full, "checkpoints", "step-3")
    assert run_entry(make_job(dp=2, train={"micro_batch": 1, "optimizer": {"lr": 0.003}}), plain, 2,
                     "--resume-from", step3) == [0, 0]
    assert [e["step"] for e in events(plain) if e["event"] == "resumed"] == [3]


def test_fp8_without_emulation_is_refused_on_the_cpu(tmp_path) -> None:
    job = make_job(train={"precision": "fp8", "steps": 2})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [2]
    failed = [e for e in events(run) if e["event"] == "failed"]
    assert failed and failed[0]["reason"].startswith("train.precision: fp8 but this rank runs on the cpu, "
                                                      "which has no FP8 tensor cores")
    assert "train.fp8.emulate: true" in failed[0]["reason"]
    assert not os.path.exists(os.path.join(run, "metrics.jsonl"))  # before any step


@pytest.mark.parametrize("device, capability, want", [
    ("cpu", None, "this rank runs on the cpu, which has no FP8 tensor cores"),
    ("cuda", (8, 0), "this rank's GPU is sm_80; FP8 GEMMs need compute capability 8.9"),
    ("cuda", (7, 0), "this rank's GPU is sm_70"),
    ("cuda", (8, 9), None),
    ("cuda", (9, 0), None),
])
def test_which_devices_run_fp8(device, capability, want) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.distributed import check_fp8_device, fp8_device_reason

    reason = fp8_device_reason(device, capability)
    assert reason is None if want is None else want in reason
    check_fp8_device("fp8", True, device, capability)  # emulated: runs anywhere
    check_fp8_device("bf16", False, device, capability)
    if want is not None:
        with pytest.raises(ConfigError, match="train.fp8.emulate: true"):
            check_fp8_device("fp8", False, device, capability)
