"""Context parallelism (runtime/parallel/context.py) trains exactly like one process (issue 25).

Every layout runs STEPS SGD steps with clipping active on the same global batches as one process of
the same model and seed (the tiny model has GQA: kv_heads 2 < heads 4, so every layout sends only the
kv heads); compared: each step's loss and pre-clip gradient norm (<= 1e-5) and every parameter after.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from hpctrain.runtime.observe.comm_timing import CP_KV, CommTimer

from ._dist import run_distributed
from ._jobs import TINY_MODEL, dp_slice, global_batch, tiny_job

STEPS = 6
MAX_NORM = 0.5
TOL = 1e-5
BF16_TOL = 2e-3  # bf16 (8-bit mantissa), FSDP mixed precision vs autocast: measured 9e-5 loss, 2e-4 norm

LAYOUTS: dict[int, list[tuple[str, dict[str, Any]]]] = {
    2: [("cp2", dict(cp=2, micro_batch=2)),
        ("cp2 ring", dict(cp=2, micro_batch=2, cp_rotate="ring")),
        ("cp2 ring bf16", dict(cp=2, micro_batch=2, precision="bf16", cp_rotate="ring")),
        # Mixed precision composes: bf16 (FSDP's policy over dp x cp) against one bf16 process, to bf16's accuracy.
        ("cp2 bf16", dict(cp=2, micro_batch=2, precision="bf16"))],
    4: [
        ("cp4 ac-selective", dict(cp=4, micro_batch=4, ac="selective")),
        ("cp2 tp2 sp", dict(cp=2, tp=2, sequence_parallel=True, micro_batch=2)),
        ("cp2 dp2 zero3 ac-full", dict(cp=2, dp=2, zero=3, micro_batch=2, ac="full")),
        ("cp2 pp2 1f1b tied", dict(cp=2, pp=2, schedule="1f1b", micro_batch=2, tie_embeddings=True)),
        # The ring (parallel.cp_rotate: ring, runtime/parallel/ring_attention.py) in the same launch.
        ("cp4 ring ac-selective", dict(cp=4, micro_batch=4, ac="selective", cp_rotate="ring")),
        ("cp2 tp2 sp ring", dict(cp=2, tp=2, sequence_parallel=True, micro_batch=2, cp_rotate="ring")),
        ("cp2 dp2 zero3 ring ac-full", dict(cp=2, dp=2, zero=3, micro_batch=2, ac="full", cp_rotate="ring")),
        ("cp2 pp2 ring", dict(cp=2, pp=2, schedule="1f1b", micro_batch=2, cp_rotate="ring")),
    ],
}


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()


def _train(kwargs: dict[str, Any], distributed: bool) -> dict[str, Any]:
    from hpctrain.runtime.parallel import ring_attention
    from hpctrain.runtime.parallel.build import build_training

    passes = [0]  # the ring's forward passes (the op looks ring_forward up when it runs)
    forward = ring_attention.ring_forward

    def counted(*args: Any, **kw: Any) -> Any:
        passes[0] += 1
        return forward(*args, **kw)

    ring_attention.ring_forward = counted  # type: ignore[assignment]
    timer = CommTimer()  # the K/V exchanges' waits, as the runtime's telemetry reads them
    timer.install()
    timer.active = True
    try:
        result = _train_steps(kwargs, distributed, build_training)
    finally:
        ring_attention.ring_forward = forward  # type: ignore[assignment]
        timer.active = False
        timer.uninstall()
    return result | {"ring_passes": passes[0], "cp_kv_s": timer.reset()[CP_KV]}


def _train_steps(kwargs: dict[str, Any], distributed: bool, build_training: Any) -> dict[str, Any]:
    job = tiny_job(**kwargs)
    training = build_training(job, torch.device("cpu"))
    optimizer = torch.optim.SGD(training.parameters(), lr=job.train.optimizer.lr)
    losses, norms = [], []
    for step in range(STEPS):
        inputs, labels = global_batch(step)
        if distributed:  # this dp rank's sequences, whole: the step takes its cp chunks of them
            dp, rank = training.dims.dp, training.dp_rank
            inputs, labels = dp_slice(inputs, rank, dp), dp_slice(labels, rank, dp)
        optimizer.zero_grad()
        losses.append(training.train_step(inputs, labels))
        norms.append(training.clip_grad_norm_(MAX_NORM))
        training.optimizer_step(optimizer)
    state = {}
    for part in training.model_parts:
        for name, value in part.state_dict().items():
            state[name] = _full(value)  # a collective over the part's mesh: every rank calls it
    return {"losses": losses, "norms": norms, "state": state}


def _group(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_train(kwargs, True) for kwargs in layouts]


@pytest.mark.dist
@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_context_parallel_layouts_match_one_process(world: int) -> None:
    layouts = LAYOUTS[world]
    start = time.monotonic()
    results = run_distributed(_group, world, [kw for _, kw in layouts], timeout_s=300)
    elapsed = time.monotonic() - start
    for i, (name, kwargs) in enumerate(layouts):
        ref = _train({k: v for k, v in kwargs.items() if k in ("tie_embeddings", "precision")} | {"micro_batch": 8}, False)
        assert all(n > MAX_NORM for n in ref["norms"]), "clipping must be active to be tested"
        assert ref["losses"][-1] < ref["losses"][0]
        loss_diff = max(abs(a - b) for r in results for a, b in zip(r[i]["losses"], ref["losses"]))
        norm_diff = max(abs(a - b) / b for r in results for a, b in zip(r[i]["norms"], ref["norms"]))
        merged: dict[str, torch.Tensor] = {}
        for r in results:
            merged.update(r[i]["state"])
        assert sorted(merged) == sorted(ref["state"]), name
        param_diff = max((merged[k] - ref["state"][k]).abs().max().item() for k in ref["state"])
        print(f"[cp parity] {name}: max|dloss|={loss_diff:.2e} max rel dnorm={norm_diff:.2e} "
              f"max|dparam|={param_diff:.2e}")
        if kwargs.get("cp_rotate") == "ring":
            # Once per layer and micro-batch per step; selective checkpointing keeps the ring's outputs,
            # full checkpointing runs it again in backward.
            micro = 8 // kwargs.get("dp", 1) // kwargs["micro_batch"]
            layers = TINY_MODEL["layers"] // kwargs.get("pp", 1)
            want = STEPS * micro * layers * (2 if kwargs.get("ac") == "full" else 1)
            want += layers if kwargs.get("pp", 1) > 1 else 0  # the pipeline stage's shape probe: one more forward
            assert all(r[i]["ring_passes"] == want for r in results), (name, [r[i]["ring_passes"] for r in results])
        else:
            assert all(r[i]["ring_passes"] == 0 for r in results), name
        assert all(r[i]["cp_kv_s"] > 0 for r in results), (name, "the K/V exchanges' waits are timed")
        tol = BF16_TOL if kwargs.get("precision") == "bf16" else TOL
        assert loss_diff <= tol, f"{name}: loss differs by {loss_diff:.2e}"
        assert norm_diff <= tol, f"{name}: grad norm differs by {norm_diff:.2e}"
        assert param_diff <= tol, f"{name}: parameters differ by {param_diff:.2e}"
    print(f"[cp parity] world={world}: {len(layouts)} layouts in {elapsed:.1f} s")


@pytest.mark.dist
@pytest.mark.slow
def test_checkpoint_from_cp2_x_dp2_resumes_onto_dp4_and_onto_cp4(tmp_path: Any) -> None:
    """A checkpoint of cp2 x dp2 (weights and AdamW moments sharded over dp x cp = 4) resumes onto cp1 x dp4
    and onto cp4 x dp1 (with the ring) through the runtime's entry point: steps 4-6 there have the losses and
    gradient norms of steps 4-6 of the saving run (every layout trains like one process). The saving run logs the K/V
    exchanges' time, a part of the exposed communication."""
    import math
    import os

    from ._entry import make_job, metrics, run_entry

    base = {"model": {"layers": 2, "seq_len": 32}, "train": {"steps": 6, "micro_batch": 1},
            "checkpoint": {"every_steps": 3, "keep_last": 3}}
    saver = make_job(dp=2, parallel={"cp": 2, "zero": 3}, cluster={"gpus_per_node": 4}, **base)
    full = str(tmp_path / "cp2xdp2")
    assert run_entry(saver, full) == [0] * 4
    lines = metrics(full)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6]
    assert all(0 < m["time_cp_kv_s"] <= m["time_comm_exposed_s"] for m in lines), lines
    checkpoint = os.path.join(full, "checkpoints", "step-3")
    # cp4 resumes with the ring (parallel.cp_rotate: ring): through the entry point, its waits logged too.
    for name, dp, cp, rotate in (("cp1xdp4", 4, 1, "allgather"), ("cp4xdp1 ring", 1, 4, "ring")):
        run = str(tmp_path / name.replace(" ", "-"))
        job = make_job(dp=dp, parallel={"cp": cp, "zero": 3, "cp_rotate": rotate}, cluster={"gpus_per_node": 4}, **base)
        assert run_entry(job, run, None, "--resume-from", checkpoint) == [0] * 4, name
        got = metrics(run)
        assert [m["step"] for m in got] == [4, 5, 6], name
        for m, want in zip(got, lines[3:]):
            for key in ("loss", "grad_norm"):
                assert math.isclose(m[key], want[key], rel_tol=1e-5, abs_tol=1e-5), (name, key, m[key], want[key])
        assert ("time_cp_kv_s" in got[0]) == (cp > 1), name
        if cp > 1:
            assert all(0 < m["time_cp_kv_s"] <= m["time_comm_exposed_s"] for m in got), (name, got)
