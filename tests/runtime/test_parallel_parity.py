"""Every (tp, pp, dp) layout trains exactly like one process (issue 3 acceptance).

Each layout runs 4 SGD steps with gradient clipping active (max_norm below the gradient norm) on
the same global batches as a single-process reference of the same model and seed. Compared: the
loss of every step (<= 1e-5), the pre-clip gradient norm, every parameter after the 4 steps, and
the state-dict names (identical to the full model's on every layout). Layouts of one world size
share one process group to pay process start-up once.

Regenerate nothing: the reference is recomputed in the test process each time.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from ._dist import run_distributed
from ._jobs import dp_slice, global_batch, tiny_job

STEPS = 4
MAX_NORM = 0.5
LOSS_TOL = 1e-5
PARAM_TOL = 1e-5

# (name, tiny_job kwargs). Coverage: all 7 layouts, each schedule, zero 1/2/3, sequence parallel,
# tied embeddings across pipeline stages and under TP, gelu and swiglu, every AC mode.
LAYOUTS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [
        ("tp2 sp", dict(tp=2, sequence_parallel=True)),
        ("tp2 tied", dict(tp=2, tie_embeddings=True, ac="selective")),
        ("pp2 gpipe tied", dict(pp=2, schedule="gpipe", micro_batch=2, tie_embeddings=True)),
        ("dp2 zero2", dict(dp=2, zero=2, micro_batch=2)),
        ("dp2 zero3 gelu", dict(dp=2, zero=3, micro_batch=1, activation="gelu")),
        ("dp2 zero0 offload", dict(dp=2, zero=0, micro_batch=2, offload_optimizer=True)),
        ("pp2 1f1b placement", dict(pp=2, schedule="1f1b", micro_batch=2, stage_layers=[[0, 1], [1, 4]])),
    ],
    4: [
        ("tp2 pp2 1f1b sp", dict(tp=2, pp=2, schedule="1f1b", sequence_parallel=True, micro_batch=2)),
        ("pp4 1f1b tied", dict(pp=4, schedule="1f1b", tie_embeddings=True)),
        ("tp2 dp2 zero3 tied ac-full", dict(tp=2, dp=2, zero=3, micro_batch=2, tie_embeddings=True, ac="full")),
        (
            "pp2 dp2 interleaved zero1 ac-selective",
            dict(pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, zero=1, ac="selective"),
        ),
    ],
    8: [
        (
            "tp2 pp2 dp2 interleaved sp zero2 tied",
            dict(
                tp=2, pp=2, dp=2, schedule="interleaved-1f1b", virtual_stages=2, sequence_parallel=True,
                zero=2, micro_batch=2, tie_embeddings=True, ac="selective",
            ),
        ),
        ("tp2 pp2 dp2 gpipe zero3 gelu", dict(tp=2, pp=2, dp=2, schedule="gpipe", zero=3, activation="gelu")),
    ],
}

MODEL_KEYS = ("tie_embeddings", "activation")


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def train_layout(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run STEPS steps on this rank; return losses, norms, and (from dp=0, tp=0) full tensors."""
    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(**kwargs)
    training = build_training(job, torch.device("cpu"))
    optimizer = torch.optim.SGD(training.parameters(), lr=job.train.optimizer.lr)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        dp, rank = training.dims.dp, training.dp_rank
        optimizer.zero_grad()
        losses.append(training.train_step(dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp)))
        norms.append(training.clip_grad_norm_(MAX_NORM))
        training.optimizer_step(optimizer)
    state = {}
    for part in training.model_parts:
        for name, value in part.state_dict().items():
            state[name] = _full(value)  # collective over the part's mesh: every rank calls it
    dims = training.dims
    assert training.mesh.mesh.flatten().tolist() == list(range(dims.world_size))
    coords = dims.coords(torch.distributed.get_rank())
    assert coords == {name: training.mesh.get_local_rank(name) for name in ("pp", "dp", "tp")}
    keep = coords.get("dp", 0) == 0 and coords.get("tp", 0) == 0
    if "stage_layers" in kwargs:
        held = [list(r[:2]) for r in _stage_ranges(training)]
        expected = kwargs["stage_layers"][training.pp_rank :: training.dims.pp]
        assert held == expected
    return {
        "losses": losses,
        "norms": norms,
        "state": state if keep else None,
        "param_count_before_dp": training.param_count_before_dp(),
        "stage_ranges": _stage_ranges(training),
        "coords": coords,
    }


def _stage_ranges(training: Any) -> list[tuple[int, int, bool, bool]]:
    ranges = []
    for part in training.model_parts:
        keys = sorted(int(k) for k in part.layers.keys())
        ranges.append((keys[0], keys[-1] + 1, part.tok_embeddings is not None, part.output is not None))
    return ranges


def run_group(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_layout(kwargs) for kwargs in layouts]


def reference(kwargs: dict[str, Any]) -> dict[str, Any]:
    """One process, no process group, one micro-batch: the ground truth for a layout."""
    model = {k: v for k, v in kwargs.items() if k in MODEL_KEYS}
    return train_layout_single(dict(model, micro_batch=8))


def train_layout_single(kwargs: dict[str, Any]) -> dict[str, Any]:
    from hpctrain.runtime.parallel.build import build_training

    job = tiny_job(**kwargs)
    training = build_training(job, torch.device("cpu"))
    assert training.mesh is None
    optimizer = torch.optim.SGD(training.parameters(), lr=job.train.optimizer.lr)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        optimizer.zero_grad()
        losses.append(training.train_step(inputs, labels))
        norms.append(training.clip_grad_norm_(MAX_NORM))
        training.optimizer_step(optimizer)
    state = {name: value.detach().clone() for name, value in training.model_parts[0].state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}


def _check_layout(name: str, ranks: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, float]:
    loss_diff = max(abs(a - b) for r in ranks for a, b in zip(r["losses"], ref["losses"]))
    norm_diff = max(abs(a - b) / b for r in ranks for a, b in zip(r["norms"], ref["norms"]))
    assert all(n > MAX_NORM for n in ref["norms"]), "clipping must be active to be tested"
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        if r["state"] is not None:
            merged.update(r["state"])
    assert sorted(merged) == sorted(ref["state"]), f"{name}: state-dict names differ from the full model"
    param_diff = max((merged[k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert loss_diff <= LOSS_TOL, f"{name}: loss differs by {loss_diff:.2e}"
    assert norm_diff <= 1e-5, f"{name}: grad norm differs by {norm_diff:.2e} (relative)"
    assert param_diff <= PARAM_TOL, f"{name}: parameters differ by {param_diff:.2e}"
    return {"loss": loss_diff, "norm_rel": norm_diff, "param": param_diff}


def _check_planner_count(name: str, kwargs: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    from hpctrain.plan.model_stats import stage_param_count

    job = tiny_job(**kwargs)
    for r in ranks:
        expected = sum(
            stage_param_count(job.model, a, b, has_embedding=emb, has_head=head, tp=job.parallel.tp)
            for a, b, emb, head in r["stage_ranges"]
        )
        held = r["param_count_before_dp"]
        assert held == expected, f"{name}: rank {r['coords']} holds {held}, planner says {expected}"


@pytest.mark.dist
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_layouts_match_single_process(world_size: int) -> None:
    layouts = LAYOUTS[world_size]
    start = time.monotonic()
    results = run_distributed(run_group, world_size, [kw for _, kw in layouts], timeout_s=240)
    elapsed = time.monotonic() - start
    for i, (name, kwargs) in enumerate(layouts):
        ranks = [per_rank[i] for per_rank in results]
        diffs = _check_layout(name, ranks, reference(kwargs))
        _check_planner_count(name, kwargs, ranks)
        print(
            f"[parity] world={world_size} {name}: max|dloss|={diffs['loss']:.2e} "
            f"max rel dnorm={diffs['norm_rel']:.2e} max|dparam|={diffs['param']:.2e}"
        )
    print(f"[parity] world={world_size}: {len(layouts)} layouts in {elapsed:.1f} s")


def test_layout_coverage() -> None:
    """The acceptance list: every layout, every schedule, zero 2 and 3, sequence parallel."""
    cases = [kw for group in LAYOUTS.values() for _, kw in group]
    shapes = {(kw.get("tp", 1), kw.get("pp", 1), kw.get("dp", 1)) for kw in cases}
    assert shapes >= {(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2), (2, 2, 2)}
    assert {kw["schedule"] for kw in cases if kw.get("pp", 1) > 1} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert {kw["zero"] for kw in cases if kw.get("dp", 1) > 1} >= {2, 3}
    assert any(kw.get("sequence_parallel") for kw in cases)


PRECISION_LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("bf16 dp2 zero3 (FSDP mixed precision)", dict(dp=2, zero=3, precision="bf16", micro_batch=2)),
    ("fp16 dp2 zero2 (FSDP mixed precision + loss scaling)", dict(dp=2, zero=2, precision="fp16", micro_batch=2)),
    ("fp16 pp2 1f1b (loss scaling inside the schedule)", dict(pp=2, schedule="1f1b", precision="fp16", micro_batch=2)),
    ("bf16 tp2 sp (autocast + loss parallel)", dict(tp=2, sequence_parallel=True, precision="bf16", micro_batch=2)),
]
PRECISION_STEPS = 8


def train_precision(kwargs: dict[str, Any]) -> dict[str, Any]:
    """AdamW on one fixed global batch: the loss must fall; returns losses and compute dtypes."""
    from hpctrain.runtime.parallel.build import build_training

    training = build_training(tiny_job(optimizer="adamw", lr=1e-2, **kwargs), torch.device("cpu"))
    dtypes: list[str] = []
    for part in training.model_parts:
        for block in part.layers.values():
            wq: Any = block.attention.wq  # type: ignore[union-attr]
            wq.register_forward_hook(lambda m, i, out: dtypes.append(str(out.dtype)))
    optimizer = torch.optim.AdamW(training.parameters(), lr=1e-2)
    inputs, labels = global_batch(0)
    dp, rank = training.dims.dp, training.dp_rank
    losses = []
    for _ in range(PRECISION_STEPS):
        optimizer.zero_grad()
        losses.append(training.train_step(dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp)))
        training.clip_grad_norm_(1.0)
        training.optimizer_step(optimizer)
    master = {str(p.dtype) for p in training.parameters()}
    return {"losses": losses, "compute_dtypes": set(dtypes), "master_dtypes": master}


def run_precision_group(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [train_precision(kwargs) for kwargs in layouts]


@pytest.mark.dist
def test_mixed_precision_layouts_train() -> None:
    results = run_distributed(run_precision_group, 2, [kw for _, kw in PRECISION_LAYOUTS], timeout_s=240)
    for i, (name, kwargs) in enumerate(PRECISION_LAYOUTS):
        ranks = [per_rank[i] for per_rank in results]
        losses = ranks[0]["losses"]
        assert all(r["losses"] == losses for r in ranks), f"{name}: ranks disagree on the loss"
        want = "torch.bfloat16" if kwargs["precision"] == "bf16" else "torch.float16"
        assert all(r["compute_dtypes"] <= {want} for r in ranks) and ranks[0]["compute_dtypes"], name
        assert all(r["master_dtypes"] == {"torch.float32"} for r in ranks), f"{name}: master weights not fp32"
        print(f"[precision] {name}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        assert losses[-1] < losses[0] - 1.0, f"{name}: loss did not fall ({losses})"
