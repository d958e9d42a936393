"""Mixture-of-Experts (runtime/model/moe.py): routing, dispatch, balancing, and parity across layouts.

The layer is checked against a per-token reference written here from the definitions (each token: the
top-k experts' SwiGLU outputs weighted by their scores, plus the shared experts), the grouped GEMM
against the per-expert loop, the balancing loss's injected gradient against an explicit `loss + c * aux`,
and whole models on dp2 (zero 3), pp2, expert parallelism (ep2, ep2 x dp2, ep2 x pp2, ep4) and expert with
tensor parallelism (sequence parallel: ep2 x tp2, ep4 over tp2 x dp2, ep2 x tp2 x dp2, ep2 x tp2 x pp2) against
one process with the same micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hpctrain.runtime.model import moe as moe_mod
from hpctrain.runtime.model.moe import MoE, MoEArgs

from ._dist import run_distributed
from ._jobs import dp_slice, global_batch, tiny_job

HIDDEN = 16


def _layer(seed: int = 0, **kwargs: Any) -> MoE:
    args = MoEArgs(**{"experts": 4, "top_k": 2, "expert_ffn_hidden": 8, **kwargs})
    torch.manual_seed(seed)
    layer = MoE(HIDDEN, args)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token, from the definitions (no sorting, no grouping)."""
    a, e = layer.args, layer.experts
    flat = x.reshape(-1, HIDDEN)
    logits = flat @ layer.router.gate.weight.T
    scores = logits.softmax(-1) if a.score == "softmax" else logits.sigmoid()
    bias = layer.router.expert_bias
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        choice = scores[t] if bias is None else scores[t] + bias
        ids = choice.topk(a.top_k).indices
        weights = scores[t, ids]
        if a.normalize_top_k:
            weights = weights / weights.sum()
        for w, i in zip(weights, ids):
            h = F.silu(e.w1[i] @ flat[t]) * (e.w3[i] @ flat[t])
            out[t] += w * (e.w2[i] @ h)
        if layer.shared is not None:
            out[t] += layer.shared(flat[t : t + 1])[0]
    return out.reshape(x.shape)


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(score="sigmoid", normalize_top_k=False),
    dict(shared_ffn_hidden=8, score="sigmoid", bias_update_rate=0.01),
])
def test_layer_matches_per_token_reference(kwargs: dict[str, Any]) -> None:
    layer = _layer(**kwargs)
    if layer.router.expert_bias is not None:
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # the bias steers the choice only
    x = torch.randn(2, 5, HIDDEN)
    assert torch.allclose(layer(x), _reference(layer, x), atol=1e-5)


def test_grouped_gemm_equals_the_per_expert_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    assert moe_mod.use_grouped_mm(torch.ones(2, 2), torch.ones(1, 2, 2)) == hasattr(torch, "_grouped_mm")
    x = torch.randn(3, 7, HIDDEN)
    results = []
    for grouped in (True, False):
        monkeypatch.setattr(moe_mod, "use_grouped_mm", lambda *_: grouped)  # force one path, then the other
        layer = _layer(shared_ffn_hidden=8)
        out = layer(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    assert torch.allclose(out_a, out_b, atol=1e-6)
    assert all(torch.allclose(grads_a[n], grads_b[n], atol=1e-6) for n in grads_a)


def test_capacity_drops_the_later_tokens_and_counts_them() -> None:
    layer = _layer(capacity_factor=0.5)  # capacity ceil(0.5 * 10 * 2 / 4) = 3 slots per expert
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[0, 0] = layer.router.gate.weight[1, 0] = 10.0  # everyone picks experts 0 and 1
    x = torch.zeros(1, 10, HIDDEN)
    x[..., 0] = 1.0
    out = layer(x)
    routed = out[0].abs().sum(-1)
    assert (routed[:3] > 0).all() and (routed[3:] == 0).all()  # the first 3 tokens fit, the rest dropped
    assert layer.stat_dropped == 20 - 6
    assert layer.stat_counts is not None and layer.stat_counts.tolist() == [10, 10, 0, 0]  # before dropping


def test_balancing_loss_gradient_is_injected_exactly() -> None:
    coeff = 0.37
    x = torch.randn(2, 6, HIDDEN, generator=torch.Generator().manual_seed(3))
    injected = _layer(aux_loss_coeff=coeff)
    injected.backward_scale = coeff
    injected(x).square().sum().backward()
    explicit = _layer(aux_loss_coeff=coeff)
    out = explicit(x)
    aux = explicit.stat_aux[0]
    # The recorded term is Switch's E * sum_i f_i P_i, from the router's own choices and probabilities (a
    # sample of 12 tokens can sit on either side of 1, the perfectly balanced value).
    scores, counts, tokens = _router_stats(explicit, x)
    probs = scores if explicit.args.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    wanted = explicit.args.experts * (counts.float() / (tokens * explicit.args.top_k) * probs.mean(0)).sum()
    assert aux.item() == pytest.approx(wanted.item(), rel=1e-6)
    (out.square().sum() + coeff * explicit._balance_loss(*_router_stats(explicit, x))).backward()
    gate_a, gate_b = injected.router.gate.weight.grad, explicit.router.gate.weight.grad
    assert gate_a is not None and gate_b is not None
    assert torch.allclose(gate_a, gate_b, atol=1e-6)
    assert not torch.allclose(gate_a, _gate_grad_without_aux(x), atol=1e-4)  # the aux term matters


def _router_stats(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    flat = x.reshape(-1, HIDDEN)
    _, ids, scores = layer.router(flat)
    return scores, torch.bincount(ids.reshape(-1), minlength=layer.args.experts), flat.shape[0]


def _gate_grad_without_aux(x: torch.Tensor) -> torch.Tensor:
    layer = _layer(aux_loss_coeff=0.37)
    layer.backward_scale = 0.0
    layer(x).square().sum().backward()
    assert layer.router.gate.weight.grad is not None
    return layer.router.gate.weight.grad


def test_bias_moves_toward_the_idle_experts() -> None:
    layer = _layer(bias_update_rate=0.01)
    layer.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert layer.router.expert_bias is not None
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])


def test_recomputation_counts_tokens_once() -> None:
    from torch.utils.checkpoint import checkpoint

    layer = _layer()
    x = torch.randn(1, 8, HIDDEN, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.stat_counts is not None and layer.stat_counts.sum().item() == 8 * 2


MOE = {"experts": 4, "top_k": 2, "expert_ffn_hidden": 32, "shared_experts": 1, "dense_layers": 1}
SOFTMAX = {**MOE, "router": {"score": "softmax", "aux_loss_coeff": 0.05}}
SIGMOID = {**MOE, "router": {"score": "sigmoid", "bias_update_rate": 0.01, "capacity_factor": 1.0}}


def test_model_parameter_count_matches_the_planner() -> None:
    from hpctrain.plan.model_stats import param_count as planner_count
    from hpctrain.runtime.model.transformer import ModelArgs, build_model, param_count

    job = tiny_job(moe=SOFTMAX, head_dim=16, qk_norm=True)
    args = ModelArgs.from_config(job.model)
    model = build_model(args)
    held = sum(p.numel() for p in model.parameters())
    assert held == param_count(args) == planner_count(job.model)
    assert type(model.layers["0"].feed_forward).__name__ == "FeedForward"
    assert isinstance(model.layers["1"].feed_forward, MoE)
    assert model.layers["1"].attention.wq.weight.shape == (4 * 16, 32)  # heads x head_dim, not hidden


def test_a_torch_without_the_mesh_unflattening_is_one_clear_error() -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.parallel.expert import sparse_mesh

    # A stand-in for an older torch's DeviceMesh, which has no _unflatten (this torch cannot produce the fault).
    with pytest.raises(ConfigError, match=r"parallel.ep: got 2; this torch .* lacks _unflatten.*set parallel.ep: 1"):
        sparse_mesh(object(), 2)


STEPS = 6
MAX_NORM = 0.05
# name, tiny_job kwargs. The reference runs one process with the same micro-batch size, so the
# balancing loss, the capacity and the bias see the same token groups.
MOE_LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("dp2 zero3 softmax+aux", dict(dp=2, zero=3, micro_batch=2, moe=SOFTMAX)),
    ("dp2 zero2 sigmoid+bias+capacity ac-full", dict(dp=2, zero=2, micro_batch=2, moe=SIGMOID, ac="full")),
    ("pp2 1f1b softmax+aux ac-selective", dict(pp=2, micro_batch=2, moe=SOFTMAX, ac="selective")),
    ("pp2 gpipe sigmoid+bias+capacity", dict(pp=2, schedule="gpipe", micro_batch=2, moe=SIGMOID)),
    # Expert parallelism (runtime/parallel/expert.py): ep borrows its ranks from dp.
    ("ep2 (dp2) softmax+aux", dict(dp=2, ep=2, zero=1, micro_batch=2, moe=SOFTMAX)),
    ("ep2 (dp2) zero3 sigmoid+bias+capacity ac-full", dict(dp=2, ep=2, zero=3, micro_batch=2, moe=SIGMOID, ac="full")),
    # Tensor parallelism (sequence parallel on): ep spans whole tp groups, each tp rank routes its own shard.
    ("ep2 x tp2 sp softmax+aux", dict(tp=2, ep=2, sequence_parallel=True, micro_batch=2, moe=SOFTMAX)),
    ("ep2 x tp2 sp sigmoid+bias+capacity ac-selective",
     dict(tp=2, ep=2, sequence_parallel=True, micro_batch=2, moe=SIGMOID, ac="selective")),
]
# On four processes: experts over efsdp x ep = 2 x 2, with pipelining, and one expert per rank.
EP_LAYOUTS_4: list[tuple[str, dict[str, Any]]] = [
    ("ep2 x dp2 (dp4) zero3 softmax+aux", dict(dp=4, ep=2, zero=3, micro_batch=2, moe=SOFTMAX)),
    ("ep2 x dp2 (dp4) zero2 sigmoid+bias+capacity", dict(dp=4, ep=2, zero=2, micro_batch=1, moe=SIGMOID)),
    ("ep2 x pp2 (pp2 dp2) 1f1b sigmoid+bias+capacity", dict(pp=2, dp=2, ep=2, zero=1, micro_batch=2, moe=SIGMOID)),
    ("ep4 (dp4) softmax+aux ac-selective", dict(dp=4, ep=4, zero=3, micro_batch=2, moe=SOFTMAX, ac="selective")),
    # ep over dp x tp: one ep group of all four ranks; ep2 = the tp groups, the experts FSDP-sharded over efsdp 2.
    ("ep4 over tp2 x dp2 sp zero3 sigmoid+bias+capacity",
     dict(dp=2, tp=2, ep=4, zero=3, sequence_parallel=True, micro_batch=2, moe=SIGMOID)),
    ("ep2 x tp2 x dp2 (efsdp2) sp zero2 softmax+aux ac-full",
     dict(dp=2, tp=2, ep=2, zero=2, sequence_parallel=True, micro_batch=1, moe=SOFTMAX, ac="full")),
    ("ep2 x tp2 x pp2 sp 1f1b softmax+aux", dict(pp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=2, moe=SOFTMAX)),
]
PARITY: dict[str, tuple[float, float]] = {}  # layout -> (max |dloss|, max rel dnorm), printed with -s


def _train(kwargs: dict[str, Any], distributed: bool) -> dict[str, Any]:
    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(**kwargs)
    training = build_training(job, torch.device("cpu"))
    optimizer = torch.optim.SGD(training.parameters(), lr=job.train.optimizer.lr)
    losses, norms, router_norms, stats, biases = [], [], [], [], []
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        if distributed:
            dp, rank = training.dims.dp, training.dp_rank
            inputs, labels = dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp)
        optimizer.zero_grad()
        losses.append(training.train_step(inputs, labels))
        stats.append(training.moe_step_stats())
        router_norms.append(_router_grad_norm(training))
        norms.append(training.clip_grad_norm_(MAX_NORM))
        training.optimizer_step(optimizer)
        biases.append({layer: m.router.expert_bias.clone() for layer, m in training.moe_layers().items()
                       if m.router.expert_bias is not None})
    ranges = []
    for part in training.model_parts:
        keys = sorted(int(k) for k in part.layers.keys())
        ranges.append((keys[0], keys[-1] + 1, part.tok_embeddings is not None, part.output is not None))
    return {"losses": losses, "norms": norms, "router_norms": router_norms, "stats": stats, "biases": biases,
            "ranges": ranges, "held": training.param_count_before_dp()}


def _router_grad_norm(training: Any) -> float:
    """The routers' share of the gradient norm, on its own: a router replicated over tp whose gradient missed
    the other sequence shards' tokens moves the whole model's norm too little to see."""
    import torch.distributed as dist

    from hpctrain.runtime.parallel.grad_norm import weighted_grad_sq

    routers = {id(p) for part in training.model_parts for name, p in part.named_parameters()
               if name.endswith("router.gate.weight")}
    sq = weighted_grad_sq([(p, w) for p, w in training._norm_weights if id(p) in routers], training.device)
    if dist.is_initialized():
        dist.all_reduce(sq)
    return math.sqrt(float(sq))


def _group(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_train(kwargs, True) for kwargs in layouts]


@pytest.mark.dist
def test_moe_layouts_match_one_process() -> None:
    results = run_distributed(_group, 2, [kw for _, kw in MOE_LAYOUTS], timeout_s=240)
    _check_against_one_process(MOE_LAYOUTS, results)


@pytest.mark.dist
def test_expert_parallel_layouts_on_four_processes_match_one_process() -> None:
    results = run_distributed(_group, 4, [kw for _, kw in EP_LAYOUTS_4], timeout_s=240)
    _check_against_one_process(EP_LAYOUTS_4, results)
    print({name: f"dloss {a:.1e} dnorm {b:.1e}" for name, (a, b) in PARITY.items()})


def _check_against_one_process(layouts: list[tuple[str, dict[str, Any]]], results: list[list[dict[str, Any]]]) -> None:
    for i, (name, kwargs) in enumerate(layouts):
        single = {k: v for k, v in kwargs.items() if k in ("moe", "micro_batch", "ac")}
        ref = _train(single, False)
        assert all(n > MAX_NORM for n in ref["norms"]), "clipping must be active to be tested"
        assert ref["losses"][-1] < ref["losses"][0]
        for per_rank in results:
            r = per_rank[i]
            loss_diff = max(abs(a - b) for a, b in zip(r["losses"], ref["losses"]))
            norm_diff = max(abs(a - b) / b for a, b in zip(r["norms"], ref["norms"]))
            worst = PARITY.get(name, (0.0, 0.0))
            PARITY[name] = (max(worst[0], loss_diff), max(worst[1], norm_diff))
            assert loss_diff <= 1e-5, f"{name}: loss differs by {loss_diff:.2e}"
            assert norm_diff <= 1e-5, f"{name}: grad norm differs by {norm_diff:.2e}"
            router_diff = max(abs(a - b) / b for a, b in zip(r["router_norms"], ref["router_norms"]))
            assert router_diff <= 1e-5, f"{name}: the routers' grad norm differs by {router_diff:.2e}"
            for got, want in zip(r["stats"], ref["stats"]):
                assert got.keys() == want.keys()
                assert all(math.isclose(got[k], want[k], rel_tol=1e-6, abs_tol=1e-9) for k in want), (name, got, want)
            from hpctrain.plan.model_stats import routed_expert_params, stage_param_count

            job = tiny_job(**kwargs)
            tp, ep = kwargs.get("tp", 1), kwargs.get("ep", 1)
            # The runtime counts its expert DTensors at their global shape (all experts): the planner's ep share
            # plus the other ep ranks' experts, per MoE block of the range.
            dense = int(job.model.moe.dense_layers)
            others = routed_expert_params(job.model) - routed_expert_params(job.model) // ep
            planned = sum(stage_param_count(job.model, a, b, has_embedding=e, has_head=h, tp=tp, ep=ep)
                          + others * max(0, b - max(a, dense)) for a, b, e, h in r["ranges"])
            assert r["held"] == planned, f"{name}: holds {r['held']}, the planner says {planned} ({r['ranges']})"
            for got_biases, want_biases in zip(r["biases"], ref["biases"]):
                for layer, bias in got_biases.items():
                    assert torch.allclose(bias, want_biases[layer], atol=1e-7), f"{name}: layer {layer} bias"
        if "bias_update_rate" in str(kwargs):
            assert any(b.abs().sum() > 0 for step in ref["biases"] for b in step.values())
        if "aux_loss_coeff" in str(kwargs):
            assert all(s["aux_loss"] >= 1.0 - 1e-6 for s in ref["stats"])


@pytest.mark.dist
def test_checkpoint_from_ep2_x_dp2_resumes_onto_ep4_onto_ep1_x_dp2_and_onto_tp2(tmp_path: Any) -> None:
    """DCP holds the experts as global tensors: a checkpoint of dp4 ep2 (each rank a quarter of the expert
    weights and their AdamW moments) resumes onto dp4 ep4, onto dp2 ep1 and onto dp2 tp2 ep2 (sequence
    parallel), and the next step is the one the saving layout ran (loss, gradient norm and the routing, which the restored router.expert_bias steers)."""
    import os

    from ._entry import make_job, metrics, run_entry

    moe = {**MOE, "router": {"score": "sigmoid", "bias_update_rate": 0.05, "capacity_factor": 1.0}}
    base = {"model": {"layers": 2, "moe": moe}, "train": {"steps": 4, "micro_batch": 1},
            "checkpoint": {"every_steps": 3, "keep_last": 3}}
    saver = make_job(dp=4, parallel={"ep": 2, "zero": 3}, **base)
    full = str(tmp_path / "ep2xdp2")
    assert run_entry(saver, full) == [0] * 4
    lines = metrics(full)
    want = lines[3]
    # the dispatch's waits, timed on their own and counted in the exposed communication
    assert all(0 < m["time_all_to_all_s"] <= m["time_comm_exposed_s"] for m in lines), lines
    checkpoint = os.path.join(full, "checkpoints", "step-3")
    # ep2 x tp2 x dp2: the experts' ep groups are the tp groups (sequence parallel, runtime/parallel/expert.py)
    for name, dp, tp, ep in (("ep4", 4, 1, 4), ("ep1xdp2", 2, 1, 1), ("ep2xtp2xdp2", 2, 2, 2)):
        run = str(tmp_path / name)
        job = make_job(dp=dp, tp=tp, parallel={"ep": ep, "zero": 3, "sequence_parallel": tp > 1}, **base)
        assert run_entry(job, run, None, "--resume-from", checkpoint) == [0] * dp * tp, name
        got = metrics(run)
        assert [m["step"] for m in got] == [4], name
        for key in ("loss", "grad_norm", "expert_load_max_over_mean", "tokens_dropped"):
            assert math.isclose(got[0][key], want[key], rel_tol=1e-5, abs_tol=1e-5), (name, key, got[0][key], want[key])
        assert ("time_all_to_all_s" in got[0]) == (ep > 1), name  # only a run with all-to-alls reports them
