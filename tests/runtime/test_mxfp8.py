"""train.fp8.recipe mxfp8 (Blackwell's microscaled FP8) through torchao's MX training GEMM, emulated on the CPU
(issue 26).

- The eligible linears become MXLinear (fp32 master weights, the same state-dict names); widths must be whole MX
  blocks on every tp shard.
- tp2 x dp2 (FSDP2, sequence parallelism) and pp2 x dp2 train like one process: MX scales are per block of 32, so
  each tp rank casts its shard with the scales one process uses.
- Without emulation the device check refuses mxfp8 below compute capability 10 in one line.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")

from hpctrain.runtime.parallel.build import build_training  # noqa: E402

from ._dist import run_distributed  # noqa: E402
from ._jobs import tiny_job  # noqa: E402
from .test_parallel_parity import _check_layout, run_group, train_layout_single  # noqa: E402

MX = {"precision": "fp8", "fp8": {"recipe": "mxfp8", "emulate": True, "min_width": 32, "high_precision": "fp32"}}
# Every width a multiple of 64 (whole blocks of 32 on each of two tp shards): hidden 64, 4 heads of 16 and 4 kv heads
# (wq, wk, wv, wo 64 wide), ffn 128; a micro-batch of 2 x 16 tokens (one block along the weight gradient's K).
WIDE = dict(hidden=64, heads=4, kv_heads=4, ffn_hidden=128)

LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("mxfp8 tp2 dp2 zero3 sp", dict(tp=2, dp=2, zero=3, micro_batch=2, sequence_parallel=True, train=MX, **WIDE)),
    ("mxfp8 pp2 dp2 1f1b zero2 ac-selective", dict(pp=2, dp=2, zero=2, micro_batch=2, ac="selective", train=MX,
                                                   **WIDE)),
]


def test_eligible_linears_become_mx_linears() -> None:
    from hpctrain.runtime.parallel.mxfp8 import MXLinear

    training = build_training(tiny_job(micro_batch=2, train=MX, **WIDE), torch.device("cpu"))
    part = training.model_parts[0]
    converted = sorted(name for name, m in part.named_modules() if isinstance(m, MXLinear))
    assert len(converted) == 4 * 7 and "output" not in converted  # wq wk wv wo w1 w2 w3 of 4 layers
    assert all(p.dtype == torch.float32 for p in training.parameters())
    plain = build_training(tiny_job(micro_batch=2, **WIDE), torch.device("cpu"))
    assert sorted(part.state_dict()) == sorted(plain.model_parts[0].state_dict())
    # the tiny model's k/v projections are 16 wide: no whole block of 32, they stay in high precision
    narrow = build_training(tiny_job(micro_batch=2, train=MX), torch.device("cpu")).model_parts[0]
    kept = {name.rsplit(".", 1)[-1] for name, m in narrow.named_modules() if isinstance(m, MXLinear)}
    assert kept == {"wq", "wo", "w1", "w2", "w3"}


def test_mx_linear_is_a_quantised_linear() -> None:
    from hpctrain.runtime.parallel.mxfp8 import mx_matmul

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=generator)
    w = torch.randn(128, 64, generator=generator)
    exact, mx = x @ w.T, mx_matmul(x, w, emulate=True)
    relative = ((mx - exact).norm() / exact.norm()).item()
    assert 1e-3 < relative < 0.06  # e4m3 keeps 3 mantissa bits: a few per cent off, never exact
    # a block's scale is a power of two: scaling a whole tensor by 2 scales the result exactly
    assert torch.equal(mx_matmul(2 * x, w, emulate=True), 2 * mx)


def test_an_emulated_mx_step_runs_under_bf16_autocast() -> None:
    # fp8's default high precision is bf16: one process without FSDP runs the model under autocast over fp32 master
    # weights, and torchao's emulation once failed there on a bf16 input against the fp32 weight (a dtype error)
    training = build_training(tiny_job(micro_batch=2, train={**MX, "fp8": {**MX["fp8"], "high_precision": "bf16"}},
                                       seq_len=32, **WIDE), torch.device("cpu"))
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = training.model_parts[0](tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in training.parameters() if p.requires_grad)


@pytest.mark.dist
def test_mxfp8_layouts_match_one_process() -> None:
    start = time.monotonic()
    results = run_distributed(run_group, 4, [kw for _, kw in LAYOUTS], timeout_s=300)
    for i, (name, kwargs) in enumerate(LAYOUTS):
        ranks = [per_rank[i] for per_rank in results]
        reference = train_layout_single(dict(micro_batch=kwargs["micro_batch"], train=MX, **WIDE))
        diffs = _check_layout(name, ranks, reference)
        print(f"[mxfp8] {name}: max|dloss|={diffs['loss']:.2e} max|dparam|={diffs['param']:.2e}")
    print(f"[mxfp8] {len(LAYOUTS)} layouts on 4 ranks in {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("capability, want", [
    ((9, 0), "this rank's GPU is sm_90; recipe mxfp8 needs MX block-scaled tensor cores, compute capability 10.x"),
    ((8, 9), "this rank's GPU is sm_89; recipe mxfp8 needs"),
    ((12, 0), "this rank's GPU is sm_120; recipe mxfp8 needs"),
    ((10, 0), None),
    ((10, 3), None),
])
def test_which_devices_run_mxfp8(capability, want) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.distributed import check_fp8_device, fp8_device_reason

    reason = fp8_device_reason("cuda", capability, "mxfp8")
    assert reason is None if want is None else reason.startswith(want)
    check_fp8_device("fp8", True, "cuda", capability, "mxfp8")  # emulated: runs anywhere
    if capability >= (8, 9):
        assert fp8_device_reason("cuda", capability, "tensorwise") is None  # the other recipes need sm_89 only
    if want is not None:
        with pytest.raises(ConfigError, match="train.fp8.emulate: true"):
            check_fp8_device("fp8", False, "cuda", capability, "mxfp8")
