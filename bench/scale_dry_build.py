"""Scale dry-build: chosen ranks of a large job, built by the runtime on fake tensors (issue 12 item 11).

    python bench/scale_dry_build.py                  # llama3-70b TP8xPP4 and Llama 3 405B TP8xPP16
    python bench/scale_dry_build.py --layouts 70b    # one layout
    python bench/scale_dry_build.py --no-trace       # parameter counts only (seconds)
    python bench/scale_dry_build.py --layouts qwen3-235b --no-trace --pp-ranks 0 1 2 3 4 5 6 7
                                                     # Qwen3-235B-A22B TP2 PP8 EP32 on 256 ranks, every stage
    python bench/scale_dry_build.py --layouts qwen3-235b --tp 1 --dp 32 --no-trace   # another layout of it

One process stands for each chosen rank: it joins a FAKE process group
(torch.testing._internal.distributed.fake_pg, backend "fake") of the job's full world size as that
rank and runs the runtime's own `build_training` (DeviceMesh, tensor + sequence parallel, the
pipeline stage split, activation checkpointing, FSDP2, the pipeline schedule object). The model is
built on meta as always; `to_empty` materialises it inside a FakeTensorMode (no storage) and
`build_training(initialise=False)` draws no values (they matter neither for shapes nor memory).
Then one training step is traced with PyTorch's MemTracker, the same tracker
bench/memory_accuracy.py checks the planner against at small scale, and the peak is printed beside
`hpctrain.plan.memory.rank_memory` for the same layout and rank (without the runtime overhead).

The step: torch's pipeline schedule cannot run on a fake process group (its start-up votes and
exchanges shapes over point-to-point messages whose values fake tensors cannot give), so this
script drives the rank's stage in 1F1B order itself: (pp - pp_rank - 1) warm-up forwards, then
forward/backward pairs, then the cool-down backwards, over pp - pp_rank + 1 micro-batches (enough
for one steady-state pair: at most pp - pp_rank micro-batches in flight, as the 1F1B schedule
keeps whatever the micro-batch count). A received activation is a fresh 16-bit tensor of the
stage-boundary shape ([micro_batch, seq/tp, hidden] with sequence parallel), a received gradient
one of the output's shape; FSDP's no-sync / final reduce-scatter follow the runtime's stage
(`perform_reduce_grad`). AdamW states exist before the traced step (a fake optimizer step first).

Found with it (torch 2.13): on the first stage the vocab-parallel embedding's backward under
sequence parallel produces a full-vocabulary [vocab, hidden] gradient on every TP rank (bf16, and
an fp32 copy) before it is redistributed to the rank's shard: ~3 GiB of temporaries at the peak of
a llama3-70b first stage that the planner does not count (its TEMP is 0.75x the traced figure).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30
# Llama 3 405B: Llama Team, "The Llama 3 Herd of Models" (arXiv:2407.21783, 2024), Table 3
# (126 layers, model dimension 16384, FFN dimension 53248, 128 attention heads, 8 key/value heads,
# vocabulary 128,256, RoPE base 500,000) and section 3.3.2 (sequence 8192; training layout TP 8,
# CP 1, PP 16, DP 64-128 with FSDP). hpctrain's config has no 405B preset, so it is defined here.
LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, vocab=128256,
                   seq_len=8192, activation="swiglu", tie_embeddings=False, rope_theta=500000.0)


# Qwen3-235B-A22B (hpctrain's preset, from the model's config.json: 94 layers, hidden 4096, 64 heads x 128,
# 4 kv heads, 128 experts top-8 of width 1536) at sequence 4096, its pre-training length (the preset's 40960
# is the context of the released model; parameters do not depend on it).
def _qwen3_235b() -> dict[str, Any]:
    from hpctrain.config.model import PRESETS

    return dict(PRESETS["qwen3-235b-a22b"], seq_len=4096)


@dataclass(frozen=True)
class Layout:
    name: str
    model: dict[str, Any]
    tp: int
    pp: int
    dp: int
    zero: int = 3
    micro_batch: int = 1
    micro_batches: int = 0  # per step per pipeline; 0: 2 * pp
    sequence_parallel: bool = True
    ac: str = "selective"
    precision: str = "bf16"
    pp_ranks: tuple[int, ...] = ()  # which pipeline ranks to build; () = first, middle, last
    ep: int = 1  # parallel.ep (model.moe): routed experts over ep ranks borrowed from dp (x tp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def ranks(self) -> tuple[int, ...]:
        return self.pp_ranks or tuple(sorted({0, self.pp // 2, self.pp - 1}))

    def job(self) -> Any:
        from hpctrain.config import job_from_dict

        n_micro = self.micro_batches or 2 * self.pp
        par = dict(tp=self.tp, pp=self.pp, dp=self.dp, zero=self.zero, schedule="1f1b" if self.pp > 1 else "none",
                   virtual_stages=1, sequence_parallel=self.sequence_parallel and self.tp > 1,
                   offload_optimizer=False, ep=self.ep)
        if self.pp == 1:
            par.pop("schedule")
        train = {"global_batch": self.dp * self.micro_batch * n_micro, "micro_batch": self.micro_batch,
                 "precision": self.precision, "activation_checkpointing": self.ac, "optimizer": {"name": "adamw"}}
        gpus = min(8, self.world)
        cluster = {"executor": "local", "nodes": self.world // gpus, "gpus_per_node": gpus}
        return job_from_dict({"name": self.name.replace(" ", "-").replace("x", "-"),
                              "model": {"preset": None, **self.model}, "train": train, "parallel": par,
                              "cluster": cluster})


def _layouts() -> dict[str, Layout]:
    from hpctrain.config.model import PRESETS

    return {
        "70b": Layout("llama3-70b TP8xPP4 DP2 zero3", dict(PRESETS["llama3-70b"]), tp=8, pp=4, dp=2),
        "405b": Layout("llama3-405b TP8xPP16 DP2 zero3", LLAMA3_405B, tp=8, pp=16, dp=2),
        # 256 ranks: the dense region pp8 x dp16 x tp2, the experts' efsdp1 x ep32 over each stage's 32 ranks.
        "qwen3-235b": Layout("qwen3-235b-a22b TP2xPP8 DP16 EP32 zero3", _qwen3_235b(), tp=2, pp=8, dp=16, ep=32),
    }


@dataclass
class RankResult:
    pp_rank: int
    global_rank: int
    first_layer: int
    last_layer: int
    params_tp: int  # after TP (and EP), before FSDP (rank_params_before_dp)
    params_local: int  # this rank's FSDP shard
    planner_params_tp: int
    traced: dict[str, float] = field(default_factory=dict)
    planner: dict[str, float] = field(default_factory=dict)
    build_s: float = 0.0
    trace_s: float = 0.0
    maxrss_gib: float = 0.0


@contextlib.contextmanager
def fake_runtime(fake_mode: Any) -> Any:
    """build_training on fake tensors: `to_empty` inside `fake_mode`, no float loss.
    Only the materialisation runs in the fake mode: DeviceMesh, TP and FSDP sharding run on meta
    outside it (DeviceMesh's coordinate arithmetic is data-dependent and fails under fake tensors)."""
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memory_accuracy import patched

    from hpctrain.runtime.model.transformer import Transformer
    from hpctrain.runtime.training import Training

    def to_empty(self: Any, *, device: Any, recurse: bool = True) -> Any:
        with fake_mode:
            return nn.Module.to_empty(self, device=device, recurse=recurse)

    from torch.distributed.tensor import _sharding_prop

    # DTensor's sharding propagation computes output metadata by running the op on global-shape
    # fake tensors in the ambient fake mode (detect_fake_mode()). MemTracker skips ops in a fake
    # mode other than the one it was entered in, but here that is the same mode, so it would count
    # those global-shape temporaries (e.g. full-vocabulary [tokens, vocab] logits under loss
    # parallel) as allocations. A separate fake mode for propagation keeps them out of the trace.
    propagation_mode = FakeTensorMode()
    patches = {(_sharding_prop, "detect_fake_mode"): lambda *args: propagation_mode,
               (Transformer, "to_empty"): to_empty,
               (Training, "_global_mean"): lambda self, local_loss: 0.0}
    with patched(patches):
        yield


def planner_figures(layout: Layout, pp_rank: int) -> tuple[int, dict[str, float], tuple[int, int]]:
    """(parameters per TP rank of the stage, planner bytes per MemTracker category, layer range)."""
    import memory_accuracy as accuracy

    from hpctrain.plan.memory import rank_memory
    from hpctrain.plan.rank_setup import RankSetup
    from hpctrain.plan.model_stats import stage_param_count
    from hpctrain.plan.stages import balanced_stage_split

    from hpctrain.config import job_from_dict

    # The model alone (not layout.job()): the planner's figures need no runtime-valid layout, so they print
    # for layouts this runtime does not build yet (--planner-only).
    model = job_from_dict({"name": "planner", "model": {"preset": None, **layout.model}}).model
    n_micro = layout.micro_batches or 2 * layout.pp
    split = balanced_stage_split(model, layout.pp, 1)
    first, last = split[pp_rank]
    params = stage_param_count(model, first, last, has_embedding=pp_rank == 0,
                               has_head=pp_rank == layout.pp - 1, tp=layout.tp, ep=layout.ep)
    setup = RankSetup(tp=layout.tp, pp=layout.pp, dp=layout.dp, micro_batch=layout.micro_batch,
                      micro_batches=n_micro, schedule="1f1b" if layout.pp > 1 else "none", virtual_stages=1,
                      ac=layout.ac, zero=layout.zero, offload_optimizer=False,
                      sequence_parallel=layout.sequence_parallel and layout.tp > 1, precision=layout.precision,
                      optimizer="adamw", foreach=False, overhead_bytes=0.0, ep=layout.ep)
    memory = rank_memory(model, split, setup, pp_rank)
    out = dict.fromkeys(accuracy.CATEGORIES, 0.0)
    for item, value in memory.items:
        out[accuracy.ITEM_CATEGORY[item]] += value
    out["Total"] = sum(out[c] for c in accuracy.CATEGORIES)
    return params, out, (first, last)


def rank_params_before_dp(training: Any) -> int:
    """Elements this rank holds after tensor and expert parallelism, before FSDP: each parameter's global
    shape with its "tp" and "ep" shard dimensions cut to this rank's chunk. `Training.param_count_before_dp`
    cuts "tp" only (the routed experts' global count); the planner's per-rank count divides them by ep."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in training.parameters():
        shape = list(p.shape)
        if isinstance(p, DTensor):
            names = p.device_mesh.mesh_dim_names or ()
            for i, placement in enumerate(p.placements):
                dim = getattr(placement, "dim", None)
                if i < len(names) and names[i] in ("tp", "ep") and placement.is_shard() and dim is not None:
                    dim, size = dim % len(shape), p.device_mesh.size(i)
                    chunk = -(-shape[dim] // size)  # torch.chunk: the last shards may be short
                    rank = p.device_mesh.get_local_rank(i)
                    shape[dim] = max(0, min(chunk, shape[dim] - rank * chunk))
        total += math.prod(shape)
    return total


def _one_f_one_b(pp: int, pp_rank: int, n: int) -> list[tuple[str, int]]:
    """The 1F1B order of one pipeline rank over n micro-batches: ("F"|"B", micro-batch)."""
    warm = min(n, pp - pp_rank - 1)
    order = [("F", i) for i in range(warm)]
    fwd, bwd = warm, 0
    while bwd < n:
        if fwd < n:
            order.append(("F", fwd))
            fwd += 1
        order.append(("B", bwd))
        bwd += 1
    return order


def _traced_step(training: Any, layout: Layout, pp_rank: int, optimizer: Any) -> None:
    """One step of this rank's stage in 1F1B order (see the module docstring)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    args, module = training.args, training.model_parts[0]
    mb, seq = layout.micro_batch, args.seq_len
    n = min(training.n_microbatches, layout.pp - pp_rank + 1)
    dtype = torch.bfloat16 if layout.precision == "bf16" else (
        torch.float16 if layout.precision == "fp16" else torch.float32)
    boundary = (mb, seq // layout.tp if layout.sequence_parallel and layout.tp > 1 else seq, args.hidden)
    pending: dict[int, torch.Tensor] = {}
    with training._contexts():
        for kind, i in _one_f_one_b(layout.pp, pp_rank, n):
            if kind == "F":
                if training.has_first_stage:
                    x = torch.randint(0, args.vocab, (mb, seq))
                else:  # the received activation (BoundedStage allocates it when its receive is posted)
                    x = torch.empty(boundary, dtype=dtype, requires_grad=True)
                out = module(x)
                if training.has_last_stage:  # the loss in the last stage: no logits kept
                    out = training._loss_fn(out, torch.randint(0, args.vocab, (mb, seq)))
                pending[i] = out
                del x, out
            else:
                if isinstance(module, FSDPModule):  # what the runtime's stage does before each backward
                    module.set_is_last_backward(False)
                    module.set_reshard_after_backward(False)
                    module.set_requires_gradient_sync(False)
                out = pending.pop(i)
                if training.has_last_stage:
                    (out / training.n_microbatches).backward()
                else:  # the received output gradient
                    out.backward(torch.empty_like(out))
                del out
    if training.schedule is not None:
        training.schedule._stage.perform_reduce_grad(1)
    elif isinstance(module, FSDPModule):
        raise RuntimeError("the dry build drives pipelined layouts only (pp > 1)")
    training._match_grad_placements()
    training.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)


def dry_build(layout: Layout, pp_rank: int, trace: bool = True) -> RankResult:
    """Build (and trace one step of) pipeline rank `pp_rank`'s first tp/dp rank on a fake group."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import memory_accuracy as accuracy
    from hpctrain.runtime.parallel.build import build_training

    planner_params, planner_mem, (first, last) = planner_figures(layout, pp_rank)
    job = layout.job()
    rank = pp_rank * layout.dp * layout.tp  # mesh order (pp, dp, tp): this stage's first rank
    # allow_non_fake_inputs: the DeviceMesh's rank tables are real tensors that FSDP reads.
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        start = time.perf_counter()
        with fake_runtime(fake_mode):
            training = build_training(job, torch.device("cpu"), initialise=False)
        result = RankResult(pp_rank, rank, first, last, rank_params_before_dp(training),
                            training.param_count_local(), planner_params, planner=planner_mem,
                            build_s=time.perf_counter() - start)
        assert training.pp_rank == pp_rank, (training.pp_rank, pp_rank)
        if trace:
            start = time.perf_counter()
            with fake_mode, fake_runtime(fake_mode):
                optimizer = torch.optim.AdamW(training.parameters(), lr=1e-4, foreach=False)
                for p in training.parameters():  # AdamW's states, as after the first real step
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tracker = accuracy._step_tracker()
                tracker.track_external(*training.model_parts, optimizer)
                with tracker:
                    _traced_step(training, layout, pp_rank, optimizer)
                snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
            named = {str(getattr(k, "name", k)): float(v) for k, v in snapshot.items()}
            traced = {c: named.get(c, 0.0) for c in accuracy.CATEGORIES}
            traced["PARAM"] += named.get("BUFFER", 0.0)
            traced["TEMP"] += named.get("OTH", 0.0)
            traced["Total"] = sum(traced[c] for c in accuracy.CATEGORIES)
            result.traced = traced
            result.trace_s = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    result.maxrss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # Linux: KiB
    return result


def dry_build_ranks(layout: Layout, pp_ranks: tuple[int, ...], trace: bool = True,
                    workers: int = 1) -> list[RankResult]:
    """dry_build of each pipeline rank, each in a fresh process: torch caches meshes (FSDP's
    TP x DP mesh) across process groups, so a second rank in the same process fails; a fresh
    process also makes ru_maxrss that rank's own."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as pool:
        futures = [pool.submit(dry_build, layout, r, trace) for r in pp_ranks]
        return [f.result() for f in futures]


def closed_form_params(layout: Layout) -> int:
    from hpctrain.runtime.model.transformer import ModelArgs, param_count

    return param_count(ModelArgs.from_config(layout.job().model))


def _ratio(planner: float, traced: float) -> str:
    return f"{planner / traced:.3f}" if traced else "-"


def report(layout: Layout, results: list[RankResult]) -> list[str]:
    import memory_accuracy as accuracy
    from tabulate import tabulate

    lines = [f"== {layout.name}: world {layout.world} (fake process group), micro-batch {layout.micro_batch} x "
             f"seq {layout.model['seq_len']}, {layout.job().train.global_batch // layout.dp // layout.micro_batch} "
             f"micro-batches/step, {layout.precision}, AC {layout.ac}, SP {layout.job().parallel.sequence_parallel}, "
             f"EP {layout.ep}; "
             f"full model {closed_form_params(layout) / 1e9:.2f}B parameters (closed form)"]
    rows = []
    for r in results:
        rows.append([r.pp_rank, r.global_rank, f"{r.first_layer}-{r.last_layer - 1}", f"{r.params_tp:,}",
                     f"{r.planner_params_tp:,}", "yes" if r.params_tp == r.planner_params_tp else "NO",
                     f"{r.params_local:,}", f"{r.build_s:.1f}", f"{r.trace_s:.1f}",
                     f"{r.maxrss_gib:.2f}"])
    lines.append(tabulate(rows, headers=["pp rank", "rank", "layers", "params/rank before FSDP (runtime)",
                                         "(planner)", "equal", "FSDP shard (runtime)", "build s", "trace s",
                                         "ru_maxrss GiB"]))
    if any(r.traced for r in results):
        rows = []
        for r in results:
            for key in (*accuracy.CATEGORIES, "Total"):
                p, t = r.planner.get(key, 0.0), r.traced.get(key, 0.0)
                rows.append([r.pp_rank if key == "PARAM" else "", key, f"{p / GIB:.2f}", f"{t / GIB:.2f}",
                             _ratio(p, t)])
        lines.append("peak of one traced step (GiB): planner (hpctrain.plan.memory.rank_memory, no runtime "
                     "overhead) vs traced (MemTracker peak snapshot on fake tensors)")
        lines.append(tabulate(rows, headers=["pp rank", "category", "planner", "traced", "planner/traced"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="*", default=["70b", "405b"], help="70b, 405b, qwen3-235b")
    for degree in ("tp", "pp", "dp", "ep"):
        parser.add_argument(f"--{degree}", type=int, default=None, help=f"override the layout's {degree}")
    parser.add_argument("--pp-ranks", type=int, nargs="*", default=None, help="default: first, middle, last")
    parser.add_argument("--no-trace", action="store_true", help="parameter counts only")
    parser.add_argument("--workers", type=int, default=1, help="ranks built at once (one process each)")
    parser.add_argument("--planner-only", action="store_true", help="the planner's per-rank parameters and "
                        "memory of every pipeline rank, nothing built (layouts the runtime refuses too)")
    args = parser.parse_args(argv)
    layouts = _layouts()
    failures = 0
    for key in args.layouts:
        layout = layouts[key]
        degrees = {d: getattr(args, d) for d in ("tp", "pp", "dp", "ep") if getattr(args, d) is not None}
        if degrees:
            layout = dataclasses.replace(layout, **degrees)
            label = " ".join(f"{d.upper()}{getattr(layout, d)}" for d in ("tp", "pp", "dp", "ep"))
            layout = dataclasses.replace(layout, name=f"{layout.name.split()[0]} {label} zero{layout.zero}")
        ranks = tuple(args.pp_ranks) if args.pp_ranks else layout.ranks()
        if args.planner_only:
            print(f"== {layout.name}: world {layout.world}, the planner's figures per pipeline rank")
            for r in (tuple(args.pp_ranks) if args.pp_ranks else tuple(range(layout.pp))):
                params, memory, (first, last) = planner_figures(layout, r)
                print(f"  pp rank {r}: layers {first}-{last - 1}, {params:,} parameters per rank before FSDP, "
                      f"peak {memory['Total'] / GIB:.2f} GiB (no runtime overhead)")
            continue
        results = dry_build_ranks(layout, ranks, trace=not args.no_trace, workers=args.workers)
        for line in report(layout, results):
            print(line, flush=True)
        print(flush=True)
        failures += sum(r.params_tp != r.planner_params_tp for r in results)
    if failures:
        print(f"{failures} pipeline rank(s) whose parameters differ from the planner's", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
