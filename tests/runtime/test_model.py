"""The model on one process: parameter counts, names across pipeline splits, seeded init,
activation checkpointing, mixed precision and fp16 loss scaling."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.plan import model_stats
from hpctrain.runtime.model.transformer import ModelArgs, build_model, make_stage, param_count
from hpctrain.runtime.parallel.build import build_training
from hpctrain.runtime.parallel.pipeline import even_split, stage_layer_ranges

from ._jobs import global_batch, tiny_job

PRESETS = ["tiny", "llama3-1b", "llama3-8b", "llama3-70b", "llama2-7b", "gpt3-13b", "gpt3-175b"]
EXTRA_SHAPES: dict[str, dict[str, Any]] = {
    "mqa gelu tied": dict(
        layers=3, hidden=48, heads=6, kv_heads=1, ffn_hidden=100, vocab=77, seq_len=8,
        activation="gelu", tie_embeddings=True,
    ),
    "mha swiglu untied": dict(
        layers=2, hidden=32, heads=4, kv_heads=4, ffn_hidden=88, vocab=50, seq_len=8,
        activation="swiglu", tie_embeddings=False,
    ),
    "gqa swiglu tied": dict(
        layers=5, hidden=64, heads=8, kv_heads=2, ffn_hidden=172, vocab=300, seq_len=8,
        activation="swiglu", tie_embeddings=True,
    ),
}


def _model_args(name: str) -> ModelArgs:
    if name in EXTRA_SHAPES:
        model = {"preset": None, **EXTRA_SHAPES[name]}
    else:
        model = {"preset": name}
    return ModelArgs.from_config(job_from_dict({"name": "count", "model": model}).model)


@pytest.mark.parametrize("name", PRESETS + list(EXTRA_SHAPES))
def test_param_count_matches_closed_form_and_planner(name: str) -> None:
    args = _model_args(name)
    model = build_model(args)  # meta: a 175B model costs no memory
    counted = sum(p.numel() for p in model.parameters())  # a tied weight is yielded once
    assert counted == param_count(args) == model_stats.param_count(args)


def test_shapes_cover_gqa_swiglu_gelu_tied_untied() -> None:
    shapes = [_model_args(n) for n in PRESETS + list(EXTRA_SHAPES)]
    assert any(a.kv_heads < a.heads for a in shapes) and any(a.kv_heads == a.heads for a in shapes)
    assert {a.activation for a in shapes} == {"gelu", "swiglu"}
    assert {a.tie_embeddings for a in shapes} == {True, False}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_stages", [2, 3, 4])
def test_stage_state_dicts_partition_the_full_model(tied: bool, n_stages: int) -> None:
    args = _model_args("tiny")
    args = ModelArgs(**{**args.__dict__, "tie_embeddings": tied})
    whole = build_model(args)
    names: list[str] = []
    for sid, (first, last) in enumerate(even_split(args.layers, n_stages)):
        stage = make_stage(whole, first, last, first=sid == 0, last=sid == n_stages - 1)
        names += list(stage.state_dict())
    assert sorted(names) == sorted(whole.state_dict())  # same names, each on exactly one stage


def _materialised(
    args: ModelArgs, seed: int, stage: tuple[int, int, bool, bool] | None = None
) -> dict[str, torch.Tensor]:
    model = build_model(args)
    if stage is not None:
        model = make_stage(model, *stage[:2], first=stage[2], last=stage[3])
    model.to_empty(device="cpu")
    model.tie_weights()
    with torch.no_grad():
        model.init_weights(seed)
    return model.state_dict()


def test_init_is_seeded_and_independent_of_the_split() -> None:
    args = ModelArgs(**{**_model_args("tiny").__dict__, "tie_embeddings": True})
    full = _materialised(args, seed=7)
    again = _materialised(args, seed=7)
    other = _materialised(args, seed=8)
    assert all(torch.equal(full[k], again[k]) for k in full)
    assert not torch.equal(full["layers.0.attention.wq.weight"], other["layers.0.attention.wq.weight"])
    last = _materialised(args, seed=7, stage=(2, 4, False, True))
    for name, value in last.items():
        assert torch.equal(value, full[name]), name
    assert torch.equal(last["output.weight"], full["tok_embeddings.weight"])  # the tied copy


def _train(
    job: Any, steps: int, optimizer: str = "sgd", lr: float = 0.5, fixed_batch: bool = False
) -> list[float]:
    training = build_training(job, torch.device("cpu"))
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(training.parameters(), lr=lr)
    else:
        opt = torch.optim.AdamW(training.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        inputs, labels = global_batch(0 if fixed_batch else step)
        opt.zero_grad()
        losses.append(training.train_step(inputs, labels))
        training.clip_grad_norm_(1.0)
        training.optimizer_step(opt)
    return losses


def test_activation_checkpointing_modes_give_identical_losses() -> None:
    runs = {ac: _train(tiny_job(ac=ac, micro_batch=4), steps=4) for ac in ("none", "selective", "full")}
    for ac in ("selective", "full"):
        diff = max(abs(a - b) for a, b in zip(runs[ac], runs["none"]))
        print(f"[ac] {ac} vs none: max|dloss|={diff:.2e}")
        assert diff <= 1e-6


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_op_counts(ac: str) -> dict[str, int]:
    training = build_training(tiny_job(ac=ac, micro_batch=8), torch.device("cpu"))
    model = training.model_parts[0]
    inputs, labels = global_batch(0)
    loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_recomputes_cheap_ops_but_no_matmuls() -> None:
    none, selective, full = (_backward_op_counts(ac) for ac in ("none", "selective", "full"))
    matmuls = ("mm", "bmm", "addmm")
    assert sum(selective.get(op, 0) for op in matmuls) == sum(none.get(op, 0) for op in matmuls)
    assert sum(full.get(op, 0) for op in matmuls) > sum(none.get(op, 0) for op in matmuls)
    assert selective.get("silu", 0) > none.get("silu", 0)  # the swiglu gate is recomputed
    norm_ops = ("_fused_rms_norm", "rsqrt")
    assert sum(selective.get(op, 0) for op in norm_ops) > sum(none.get(op, 0) for op in norm_ops)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision: str) -> None:
    job = tiny_job(precision=precision, micro_batch=4, optimizer="adamw", lr=1e-2)
    training = build_training(job, torch.device("cpu"))
    seen: list[torch.dtype] = []
    wq: Any = training.model_parts[0].layers["0"].attention.wq  # type: ignore[union-attr]
    wq.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    opt = torch.optim.AdamW(training.parameters(), lr=1e-2)
    inputs, labels = global_batch(0)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        losses.append(training.train_step(inputs, labels))
        training.clip_grad_norm_(1.0)
        assert training.optimizer_step(opt)
    assert seen[0] == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert all(p.dtype == torch.float32 for p in training.parameters())  # fp32 master weights
    print(f"[precision] {precision}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < losses[0] - 1.0


def test_fp16_loss_scaler_skips_the_step_on_overflow() -> None:
    training = build_training(tiny_job(precision="fp16", micro_batch=8), torch.device("cpu"))
    scaler = training.loss_scaler
    assert scaler is not None
    opt = torch.optim.SGD(training.parameters(), lr=0.5)
    before = [p.detach().clone() for p in training.parameters()]
    scaler.scale = 2.0**100  # the scaled loss overflows fp16 gradients
    inputs, labels = global_batch(0)
    training.train_step(inputs, labels)
    assert scaler.found_inf
    assert not training.optimizer_step(opt)
    assert all(torch.equal(a, p) for a, p in zip(before, training.parameters()))
    assert scaler.scale == 2.0**99
    scaler.scale = 2.0**10
    opt.zero_grad()
    training.train_step(inputs, labels)
    assert not scaler.found_inf and training.optimizer_step(opt)
    assert any(not torch.equal(a, p) for a, p in zip(before, training.parameters()))


def test_model_args_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="model.kv_heads"):
        ModelArgs(layers=1, hidden=32, heads=4, kv_heads=3, ffn_hidden=8, vocab=8, seq_len=4)
    with pytest.raises(ConfigError, match="model.activation"):
        ModelArgs(layers=1, hidden=32, heads=4, kv_heads=4, ffn_hidden=8, vocab=8, seq_len=4, activation="relu")


def test_even_split_and_placement_validation() -> None:
    assert even_split(4, 2) == [(0, 2), (2, 4)]
    assert even_split(5, 3) == [(0, 1), (1, 3), (3, 5)]
    job = tiny_job(pp=2, stage_layers=[[0, 1], [2, 4]])
    with pytest.raises(ConfigError, match="placement.stage_layers"):
        stage_layer_ranges(job, 2, 1)
    assert stage_layer_ranges(tiny_job(pp=2, stage_layers=[[0, 3], [3, 4]]), 2, 1) == [(0, 3), (3, 4)]
    planned = stage_layer_ranges(tiny_job(pp=2, virtual_stages=2, schedule="interleaved-1f1b"), 2, 2)
    assert len(planned) == 4  # no placement: the planner's balanced split


def test_user_errors_are_config_errors() -> None:
    job = tiny_job()
    bad = job.model_copy(update={"train": job.train.model_copy(update={"micro_batch": 3})})  # skips validation
    with pytest.raises(ConfigError, match="train.micro_batch"):
        build_training(bad, torch.device("cpu"))
    with pytest.raises(ConfigError, match="activation_checkpointing"):
        auto_ac = {
            "name": "x",
            "model": {"preset": "tiny"},
            "train": {"micro_batch": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "parallel": {"tp": 1, "pp": 1, "dp": 1},
        }
        build_training(job_from_dict(auto_ac), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: bf16 with the flash SDPA kernel runs only there"
)
def test_bf16_flash_attention_on_gpu() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    job = tiny_job(precision="bf16", micro_batch=8, optimizer="adamw", lr=1e-2)
    training = build_training(job, torch.device("cuda"))
    opt = torch.optim.AdamW(training.parameters(), lr=1e-2)
    inputs, labels = global_batch(0)
    losses = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # fails if the model's attention cannot use flash
        for _ in range(5):
            opt.zero_grad()
            losses.append(training.train_step(inputs, labels))
            training.optimizer_step(opt)
    assert losses[-1] < losses[0]
