"""Context parallelism with Mixture-of-Experts and expert parallelism ("MoE parallel folding": ep borrows its ranks
from dp x cp x tp, runtime/parallel/expert.py) trains exactly like one process.

The same check as tests/runtime/test_moe.py's layouts (its `_train` and `_check_against_one_process`): STEPS SGD steps
with clipping active on the same global batches as one process with the same micro-batch size; each step's loss and
pre-clip gradient norm within 1e-5 (relative for the norm), the routers' own gradient norm too, the step's expert
load, tokens dropped and balancing loss equal (rel 1e-6), the routing biases after each step, and the parameters
each rank holds against the planner's count. Both K/V rotations (allgather, ring); capacity (whose kept slots
depend on one process's token order, which a cp rank's head and tail chunks do not follow) and both balancing
methods; the ep group inside a cp group, across cp groups and dp, equal to the tp groups, and across tp x cp.
"""

from __future__ import annotations

from typing import Any

import pytest

from ._dist import run_distributed
from .test_moe import PARITY, SIGMOID, SOFTMAX, _check_against_one_process, _group

# tiny_job's seq_len 16: cp2 chunks of 4 tokens (a rank holds positions 0-3 and 12-15, or 4-11), cp4 chunks of 2.
CP_MOE_LAYOUTS_2: list[tuple[str, dict[str, Any]]] = [
    # The ep group is the cp group: each rank's experts get the tokens of both halves of the sequence.
    ("cp2 x ep2 softmax+aux", dict(cp=2, ep=2, micro_batch=2, moe=SOFTMAX)),
    ("cp2 x ep2 ring sigmoid+bias+capacity ac-selective",
     dict(cp=2, ep=2, cp_rotate="ring", micro_batch=2, moe=SIGMOID, ac="selective")),
    # Without expert parallelism the routing statistics still span the cp ranks (context.py moe_sequence_shards).
    ("cp2 (ep1) sigmoid+bias+capacity", dict(cp=2, micro_batch=2, moe=SIGMOID)),
]
CP_MOE_LAYOUTS_4: list[tuple[str, dict[str, Any]]] = [
    ("cp2 x dp2 ep4 zero3 softmax+aux", dict(cp=2, dp=2, ep=4, zero=3, micro_batch=2, moe=SOFTMAX)),
    # ep2 = the cp groups, the experts FSDP-sharded over efsdp 2 (across dp).
    ("cp2 x dp2 ep2 (efsdp2) zero2 sigmoid+bias+capacity ac-full",
     dict(cp=2, dp=2, ep=2, zero=2, micro_batch=1, moe=SIGMOID, ac="full")),
    # ep2 = the tp groups (sequence parallel), efsdp 2 across cp; ep4 = every rank's tokens of one micro-batch.
    ("cp2 x tp2 ep2 sp sigmoid+bias+capacity", dict(cp=2, tp=2, ep=2, sequence_parallel=True, micro_batch=2,
                                                     moe=SIGMOID)),
    ("cp2 x tp2 ep4 sp ring softmax+aux ac-selective",
     dict(cp=2, tp=2, ep=4, sequence_parallel=True, cp_rotate="ring", micro_batch=2, moe=SOFTMAX, ac="selective")),
    # cp4: chunks of 2 tokens, each rank's head and tail far apart; the ring passes 3 rotations.
    ("cp4 x ep2 ring sigmoid+bias+capacity", dict(cp=4, ep=2, cp_rotate="ring", micro_batch=2, moe=SIGMOID)),
    ("cp2 x pp2 ep2 1f1b softmax+aux", dict(cp=2, pp=2, ep=2, micro_batch=2, moe=SOFTMAX)),
]


@pytest.mark.dist
@pytest.mark.parametrize("world, layouts", [(2, CP_MOE_LAYOUTS_2), (4, CP_MOE_LAYOUTS_4)], ids=["2", "4"])
def test_context_and_expert_parallel_layouts_match_one_process(world: int, layouts: list[tuple[str, dict[str, Any]]]) -> None:
    results = run_distributed(_group, world, [kw for _, kw in layouts], timeout_s=300)
    _check_against_one_process(layouts, results)
    print({name: f"dloss {a:.1e} dnorm {b:.1e}" for name, (a, b) in PARITY.items() if name.startswith("cp")})


@pytest.mark.dist
def test_checkpoint_from_cp2_x_ep2_resumes_onto_dp2_ep2_onto_cp2_ep1_and_onto_cp2_x_dp2_ep4(tmp_path: Any) -> None:
    """DCP holds the experts as global tensors whatever mesh they were sharded over: a checkpoint of cp2 x ep2
    (the ep group is the cp group; the experts' efsdp mesh has one rank) resumes onto dp2 ep2 (no context
    parallelism), onto cp2 ep1 (experts whole, FSDP over dp x cp) and onto cp2 x dp2 ep4 (efsdp 1 over four ranks),
    and the next step is the one the saving layout ran (loss, gradient norm, and the routing the restored
    router.expert_bias steers: expert load, tokens dropped)."""
    import math
    import os

    from ._entry import make_job, metrics, run_entry

    moe = {**SIGMOID, "router": {"score": "sigmoid", "bias_update_rate": 0.05, "capacity_factor": 1.0}}
    base = {"model": {"layers": 2, "moe": moe}, "train": {"steps": 4, "micro_batch": 1},
            "checkpoint": {"every_steps": 3, "keep_last": 3}}
    saver = make_job(dp=1, parallel={"cp": 2, "ep": 2, "zero": 3}, cluster={"gpus_per_node": 2}, **base)
    full = str(tmp_path / "cp2xep2")
    assert run_entry(saver, full) == [0] * 2
    want = metrics(full)[3]
    checkpoint = os.path.join(full, "checkpoints", "step-3")
    for name, dp, cp, ep in (("dp2 ep2", 2, 1, 2), ("cp2 ep1", 1, 2, 1), ("cp2 x dp2 ep4", 2, 2, 4)):
        run = str(tmp_path / name.replace(" ", "_"))
        job = make_job(dp=dp, parallel={"cp": cp, "ep": ep, "zero": 3}, cluster={"gpus_per_node": dp * cp}, **base)
        assert run_entry(job, run, None, "--resume-from", checkpoint) == [0] * dp * cp, name
        got = metrics(run)
        assert [m["step"] for m in got] == [4], name
        for key in ("loss", "grad_norm", "expert_load_max_over_mean", "tokens_dropped"):
            assert math.isclose(got[0][key], want[key], rel_tol=1e-5, abs_tol=1e-5), (name, key, got[0][key], want[key])
        assert ("time_cp_kv_s" in got[0]) == (cp > 1) and ("time_all_to_all_s" in got[0]) == (ep > 1), name
