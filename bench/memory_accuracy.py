"""Planner memory vs what PyTorch's MemTracker measures for one training step of the runtime.

    python bench/memory_accuracy.py            # all configurations, a table, exit 1 if any is off
    python bench/memory_accuracy.py --quick    # a few of each kind

Each configuration builds the rank's model with `hpctrain.runtime.parallel.build.build_training`,
runs a step of `Training.train_step` + AdamW after a warm-up step of one sequence per micro-batch (foreach=False:
the foreach temporary is modelled analytically, and fake tensors over-count it under FSDP) under
`torch.distributed._tools.mem_tracker.MemTracker`, and compares the peak snapshot, category by
category, with `hpctrain.plan.memory.rank_memory` for that rank.

How each kind runs (facts measured on torch 2.13 CPU):
- "fake": FakeTensorMode (no memory used, 1B-parameter models in seconds); FSDP2 over the fake
  process group of torch.testing._internal.distributed.fake_pg.
- "real": real tensors on a small model over the fake process group (tensor parallelism fails
  under FakeTensorMode).
- "gloo": real tensors, one process per rank over gloo (pipelining exchanges shapes through
  point-to-point messages, which neither fake tensors nor the fake group can answer; expert parallelism's
  all-to-all splits are token counts, values fake tensors do not have). One group per world size.

Under expert parallelism the measured rank's experts compute the rows its router and its peers' send them;
the planner assumes a balanced load (RankSetup.expert_load_imbalance = 1.0) and the table prints the load the
rank had (tokens are seeded per rank, so every run routes the same).

The planner's items map onto MemTracker's categories by ITEM_CATEGORY; components smaller than
SMALL_SHARE of the total are held to SMALL_SHARE of the total instead of TOLERANCE of themselves.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOLERANCE = 0.05
SMALL_SHARE = 0.01
CATEGORIES = ("PARAM", "GRAD", "OPT", "ACT", "TEMP")
ITEM_CATEGORY = {
    "fp32 master weights": "PARAM", "unsharded compute weights (FSDP)": "PARAM", "RoPE tables": "PARAM",
    "gradients": "GRAD", "optimizer states": "OPT",
    "saved activations": "ACT", "autocast weight copies": "ACT", "pipeline stage buffers": "ACT", "recompute of one layer (activation checkpointing)": "ACT",
    # MemTracker files these under Temp: FSDP's unsharded accumulation lives outside .grad.
    "unsharded fp32 gradient accumulation (FSDP, deferred reduce-scatter)": "TEMP",
    "loss gradient buffers": "TEMP", "backward gradient buffers": "TEMP",
    "gradient reduce-scatter buffer (FSDP)": "TEMP", "foreach optimizer temporary": "TEMP",
}
BIG = dict(layers=8, hidden=2048, heads=16, kv_heads=4, ffn_hidden=8192, vocab=32000, seq_len=2048,
           activation="swiglu")  # 0.6B parameters (16 layers passed the same checks at 2.6x the CPU)
BIG_GELU = dict(BIG, activation="gelu", kv_heads=16, tie_embeddings=True)
SMALL = dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=704, vocab=2048, seq_len=256, activation="swiglu")
# Mixture of Experts (runtime/model/moe.py): 8 experts, top-2. Fake tensors need the grouped GEMM's bf16
# kernel (its meta function takes bf16 only), so fp32 is measured with real tensors on a small shape.
MOE = dict(layers=4, hidden=1024, heads=8, kv_heads=4, ffn_hidden=2816, vocab=32000, seq_len=2048,
           activation="swiglu", moe=dict(experts=8, top_k=2, expert_ffn_hidden=1408))
MOE_SHARED = dict(MOE, moe=dict(experts=8, top_k=2, expert_ffn_hidden=1024, shared_experts=1, dense_layers=1))
MOE_SMALL = dict(SMALL, moe=dict(experts=8, top_k=2, expert_ffn_hidden=352))
# Expert parallelism needs real all-to-alls (gloo processes, real tensors): a shape between SMALL and MOE.
MOE_MID = dict(layers=4, hidden=512, heads=8, kv_heads=4, ffn_hidden=1408, vocab=8192, seq_len=512,
               activation="swiglu", moe=dict(experts=8, top_k=2, expert_ffn_hidden=704))
# Two layers, a dense one and a MoE one: FSDP's gathered block at the end of forward (the MoE one) and of backward (the
# dense one) differ most from the mean layer here (plan/states.py's ModelCounts.first_block / last_block; the planner
# took the mean until 2026-12-07 and missed the parameters by -6.4 % on this shape).
MOE_MID_SHARED = dict(MOE_MID, layers=2, moe=dict(experts=8, top_k=2, expert_ffn_hidden=512, shared_experts=1,
                                                  dense_layers=1))


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "fake" | "real" | "gloo"
    model: dict[str, Any]
    parallel: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    pp_rank: int = 0

    def job(self) -> Any:
        from hpctrain.config import job_from_dict

        par = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "schedule": "1f1b", "virtual_stages": 1, "zero": 0,
               "sequence_parallel": False, "offload_optimizer": False, **self.parallel}
        train = {"global_batch": 2, "micro_batch": 2, "precision": "bf16", "activation_checkpointing": "none",
                 "optimizer": {"name": "adamw"}, **self.train}
        world = par["tp"] * par["pp"] * par["dp"] * par.get("cp", 1)
        return job_from_dict({"name": self.name, "model": {"preset": None, **self.model}, "train": train,
                              "parallel": par, "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": world}})


def _c(name: str, kind: str, model: dict, pp_rank: int = 0, **kw: Any) -> Config:
    par = {k: v for k, v in kw.items() if k in ("tp", "pp", "dp", "ep", "schedule", "virtual_stages", "zero",
                                                 "sequence_parallel", "cp", "cp_rotate")}
    train = {k: v for k, v in kw.items() if k not in par}
    return Config(name, kind, model, par, train, pp_rank)


CONFIGS: list[Config] = [
    _c("1 GPU fp32", "fake", BIG, precision="fp32"),
    _c("1 GPU bf16", "fake", BIG),
    _c("1 GPU bf16 selective", "fake", BIG, activation_checkpointing="selective"),
    _c("1 GPU bf16 full", "fake", BIG, activation_checkpointing="full"),
    _c("1 GPU bf16 2 micro-batches", "fake", BIG, micro_batch=1),
    _c("1 GPU gelu tied fp32 selective", "fake", BIG_GELU, precision="fp32", activation_checkpointing="selective"),
    _c("dp8 zero1 bf16", "fake", BIG, dp=8, zero=1, global_batch=16),
    _c("dp8 zero1 bf16 2 micro-batches", "fake", BIG, dp=8, zero=1, global_batch=16, micro_batch=1),
    _c("dp8 zero2 bf16 selective", "fake", BIG, dp=8, zero=2, global_batch=16, activation_checkpointing="selective"),
    _c("dp8 zero2 fp32 2 micro-batches", "fake", BIG, dp=8, zero=2, global_batch=16, micro_batch=1, precision="fp32"),
    _c("dp8 zero3 bf16", "fake", BIG, dp=8, zero=3, global_batch=16),
    _c("dp8 zero3 bf16 full", "fake", BIG, dp=8, zero=3, global_batch=16, activation_checkpointing="full"),
    _c("dp8 zero3 gelu fp32", "fake", BIG_GELU, dp=8, zero=3, global_batch=16, precision="fp32"),
    _c("tp2 fp32", "real", SMALL, tp=2, precision="fp32"),
    _c("tp2 bf16 selective", "real", SMALL, tp=2, activation_checkpointing="selective"),
    _c("tp2 sp bf16", "real", SMALL, tp=2, sequence_parallel=True),
    _c("tp2 sp fp32 selective", "real", SMALL, tp=2, sequence_parallel=True, precision="fp32",
       activation_checkpointing="selective"),
    _c("tp2 bf16 full", "real", SMALL, tp=2, activation_checkpointing="full"),
    _c("tp2 dp2 zero2 bf16", "real", SMALL, tp=2, dp=2, zero=2, global_batch=4),
    _c("pp2 1f1b fp32 first stage", "gloo", SMALL, pp=2, global_batch=4, micro_batch=1, precision="fp32"),
    _c("pp2 1f1b fp32 last stage", "gloo", SMALL, pp_rank=1, pp=2, global_batch=4, micro_batch=1, precision="fp32"),
    _c("pp2 gpipe bf16 first stage", "gloo", SMALL, pp=2, schedule="gpipe", global_batch=4, micro_batch=1),
    _c("pp2 interleaved v2 bf16 first stage", "gloo", SMALL, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
       global_batch=4, micro_batch=1),
    _c("pp2 1f1b bf16 selective last stage", "gloo", SMALL, pp_rank=1, pp=2, global_batch=4, micro_batch=1,
       activation_checkpointing="selective"),
    _c("moe 1 GPU fp32", "real", MOE_SMALL, precision="fp32"),
    _c("moe 1 GPU bf16", "fake", MOE),
    _c("moe 1 GPU bf16 selective", "fake", MOE, activation_checkpointing="selective"),
    _c("moe 1 GPU bf16 full", "fake", MOE, activation_checkpointing="full"),
    _c("moe dp4 zero1 bf16", "fake", MOE, dp=4, zero=1, global_batch=8),
    _c("moe dp4 zero3 bf16 full", "fake", MOE, dp=4, zero=3, global_batch=8, activation_checkpointing="full"),
    _c("moe shared + dense layer dp4 zero2 bf16 selective 2 micro-batches", "fake", MOE_SHARED, dp=4, zero=2,
       global_batch=8, micro_batch=1, activation_checkpointing="selective"),
    # Expert parallelism (runtime/parallel/expert.py): real all-to-alls need real processes, so these run
    # as one gloo group of four (dp4: efsdp 2 at ep2, 1 at ep4); rank 0 is measured and its experts get the
    # tokens its router sends them (planner: expert_load_imbalance 1.0).
    _c("moe ep2 dp4 zero1 bf16", "gloo", MOE_MID, dp=4, ep=2, zero=1, global_batch=8),
    _c("moe ep2 dp4 zero3 bf16 full", "gloo", MOE_MID, dp=4, ep=2, zero=3, global_batch=8,
       activation_checkpointing="full"),
    _c("moe ep4 dp4 zero3 bf16", "gloo", MOE_MID, dp=4, ep=4, zero=3, global_batch=8),
    _c("moe ep4 dp4 zero1 bf16 selective 2 micro-batches", "gloo", MOE_MID, dp=4, ep=4, zero=1, global_batch=8,
       micro_batch=1, activation_checkpointing="selective"),
    _c("moe shared + dense layer ep2 dp4 zero3 fp32 selective", "gloo", MOE_MID_SHARED, dp=4, ep=2, zero=3,
       global_batch=8, precision="fp32", activation_checkpointing="selective"),
    _c("moe ep4 dp4 zero1 bf16 full", "gloo", MOE_MID, dp=4, ep=4, zero=1, global_batch=8,
       activation_checkpointing="full"),
]

# Context parallelism (runtime/parallel/context.py): real tensors over the fake process group (the K/V
# all-gather returns uninitialised values there, which memory does not depend on). 2 x 2048-token
# sequences: 1024 (cp2) or 512 (cp4) tokens per rank, plus the other ranks' K/V per layer.
CP_SMALL = dict(SMALL, seq_len=2048)
CP_CONFIGS: list[Config] = [
    _c("cp2 fp32", "real", CP_SMALL, cp=2, precision="fp32"),
    _c("cp2 bf16", "real", CP_SMALL, cp=2),
    _c("cp4 bf16 selective", "real", CP_SMALL, cp=4, activation_checkpointing="selective"),
    _c("cp2 tp2 sp bf16", "real", CP_SMALL, cp=2, tp=2, sequence_parallel=True),
    _c("cp2 dp2 zero3 bf16 full", "real", CP_SMALL, cp=2, dp=2, zero=3, global_batch=4,
       activation_checkpointing="full"),
    # The ring (parallel.cp_rotate: ring): the local K/V unrepeated, a pair in flight.
    _c("cp2 ring bf16", "real", CP_SMALL, cp=2, cp_rotate="ring"),
    _c("cp4 ring bf16 selective", "real", CP_SMALL, cp=4, cp_rotate="ring", activation_checkpointing="selective"),
]
CONFIGS += CP_CONFIGS
# Context with expert parallelism (ep borrows its ranks from dp x cp x tp, runtime/parallel/expert.py): real
# all-to-alls and K/V exchanges in the gloo group of four, 256 of the 512 tokens per rank; the experts over
# efsdp = dp x cp / ep (2 at ep2, 1 at ep4).
CP_EP_CONFIGS: list[Config] = [
    _c("moe cp2 dp2 ep2 zero1 bf16", "gloo", MOE_MID, cp=2, dp=2, ep=2, zero=1, global_batch=4),
    _c("moe cp2 dp2 ep4 zero3 bf16 ring", "gloo", MOE_MID, cp=2, dp=2, ep=4, zero=3, global_batch=4, cp_rotate="ring"),
]
CONFIGS += CP_EP_CONFIGS
# FP8 (train.precision fp8, runtime/parallel/float8.py and mxfp8.py): torchao's emulation on the CPU (the casts, the
# scales and what each linear saves are the GPU path's; the GEMMs dequantise), every linear of the small shape
# converted (fp8.min_width 16); under FSDP tensorwise gathers the weights in fp8.
FP8 = {"recipe": "tensorwise", "emulate": True, "min_width": 16}
FP8_CONFIGS: list[Config] = [
    _c("fp8 tensorwise 1 GPU", "real", SMALL, precision="fp8", fp8=FP8),
    _c("fp8 tensorwise 1 GPU selective", "real", SMALL, precision="fp8", fp8=FP8, activation_checkpointing="selective"),
    _c("fp8 rowwise 1 GPU", "real", SMALL, precision="fp8", fp8={**FP8, "recipe": "rowwise"}),
    # MXLinear's emulation under bf16 autocast multiplies in the fp32 weight's precision (runtime/parallel/mxfp8.py:
    # it casts the bf16 input up, which the GPU's MX kernels do not), so the MX configurations measure fp8's high
    # precision in fp32, as tests/runtime/test_mxfp8.py does
    _c("mxfp8 1 GPU fp32", "real", SMALL, precision="fp8", fp8={**FP8, "recipe": "mxfp8", "high_precision": "fp32"}),
    _c("mxfp8 dp2 zero3 fp32", "real", SMALL, precision="fp8", fp8={**FP8, "recipe": "mxfp8", "high_precision": "fp32"},
       dp=2, zero=3, global_batch=4),
    _c("fp8 tensorwise dp2 zero3", "real", SMALL, precision="fp8", fp8=FP8, dp=2, zero=3, global_batch=4),
]
CONFIGS += FP8_CONFIGS


def predict(cfg: Config) -> dict[str, float]:
    """The planner's bytes per MemTracker category for the configuration's rank."""
    from hpctrain.plan.lora import lora_shape
    from hpctrain.plan.memory import rank_memory
    from hpctrain.plan.rank_setup import RankSetup
    from hpctrain.plan.stages import balanced_stage_split

    job = cfg.job()
    p, t = job.parallel, job.train
    from hpctrain.plan.planner import planned_precision

    setup = RankSetup(tp=p.tp, pp=p.pp, dp=p.dp, micro_batch=t.micro_batch,
                      micro_batches=t.global_batch // p.dp // t.micro_batch,
                      schedule=p.schedule if p.pp > 1 else "none", virtual_stages=p.virtual_stages,
                      ac=t.activation_checkpointing, zero=p.zero, offload_optimizer=p.offload_optimizer,
                      sequence_parallel=p.sequence_parallel, precision=planned_precision(job), optimizer="adamw",
                      foreach=False, overhead_bytes=0.0, lora=lora_shape(job), ep=p.ep, cp=p.cp,
                      cpu_attention=True, cp_rank=0, cp_rotate=p.cp_rotate,  # measured on the CPU, on rank 0
                      fp8_recipe=t.fp8.recipe if t.precision == "fp8" else None, fp8_min_width=t.fp8.min_width)
    memory = rank_memory(job.model, balanced_stage_split(job.model, p.pp, p.virtual_stages), setup, cfg.pp_rank)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for item, value in memory.items:
        out[ITEM_CATEGORY[item]] += value
    out["Total"] = sum(out[c] for c in CATEGORIES)
    return out


# ----------------------------------------------------------------------------------- measuring
@contextlib.contextmanager
def _fake_friendly_runtime(fake: bool) -> Any:
    """Let build_training run under FakeTensorMode: build on the (fake) CPU instead of meta, skip
    to_empty (the parameters already exist), keep make_stage's copies in the same fake mode, and
    return no float loss. Each patch is undone on exit."""
    import torch

    import hpctrain.runtime.parallel.build as build_module
    from hpctrain.runtime.model.transformer import Transformer
    from hpctrain.runtime.training import Training

    def build(args: Any) -> Any:
        model = Transformer(args)
        for name in ("rope_cos", "rope_sin"):
            model.register_buffer(name, torch.empty(getattr(model, name).shape), persistent=False)
        return model

    patches = {
        (build_module, "build_model"): build,
        (Transformer, "to_empty"): lambda self, *, device, recurse=True: self,
        (Transformer, "__deepcopy__"): lambda self, memo: build(self.args),
        (Training, "_global_mean"): lambda self, local_loss: 0.0,
        # Fake tensors hold no values to draw, and the sharded fill asks DTensor for shard offsets
        # (data-dependent under FakeTensorMode); initialisation allocates nothing that stays.
        (Training, "initialise"): lambda self, fill=None: None,
    }
    with patched(patches if fake else {}):
        yield


@contextlib.contextmanager
def patched(patches: dict[tuple[Any, str], Any]) -> Iterator[None]:
    """Set each (owner, attribute) to its value; on exit restore it, or delete what was not there."""
    missing = object()
    saved = {key: key[0].__dict__.get(key[1], missing) for key in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            if value is missing:
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


class _NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass


def _step_tracker() -> Any:
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """MemTracker that accepts the root module running once per micro-batch."""

        def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
            for p in module.parameters():
                if not p.requires_grad:  # frozen (LoRA's base): no gradient to hook, which MemTracker would try
                    self._param_to_grad_hook_handles.setdefault(p, (_NoHook(), _NoHook()))
            name = self._mod_tracker.get_known_fqn(module)
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    # Forget this root's per-module stats only (other pipeline chunks keep theirs).
                    for sub in module.modules():
                        self.memory_tracking.pop(sub, None)
            super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module: Any, inputs: Any, outputs: Any) -> None:
            # FSDP2 gathers a unit of several modules ([norm, output]) in the first one's
            # pre-forward, after this tracker's own pre-forward hook of that module has looked
            # at its parameters: file the gathered parameters as PARAM once they are in place.
            self._track_module_params_and_buffers(module, install_grad_hooks=False)
            super()._post_fw_hook(module, inputs, outputs)

    return StepTracker()


def _measure_here(cfg: Config, fake: bool, track: bool = True) -> dict[str, float]:
    """Two steps on this process's rank; the peak snapshot per category (bytes). `track` False: the same two steps
    (and collectives) without MemTracker, for a gloo rank whose measurement nobody reads ({})."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hpctrain.runtime.parallel.dims import ParallelDims
    from hpctrain.runtime.parallel.build import build_training

    job = cfg.job()
    original_mesh = ParallelDims.build_mesh
    if dist.is_initialized() and fake:
        mesh = original_mesh(ParallelDims.from_job(job, dist.get_world_size()), "cpu")
        setattr(ParallelDims, "build_mesh", lambda self, device_type: mesh)
    try:
        with _fake_friendly_runtime(fake), (FakeTensorMode() if fake else contextlib.nullcontext()):
            training = build_training(job, torch.device("cpu"))
            optimizer = torch.optim.AdamW(training.parameters(), lr=1e-4, foreach=False)
            local = job.train.global_batch // job.parallel.dp

            seed = dist.get_rank() if dist.is_initialized() else 0
            generator = torch.Generator().manual_seed(1000 + seed)  # the same tokens (and routing) every run

            def step(sequences: int = local) -> None:
                tokens = torch.randint(0, job.model.vocab, (local, job.model.seq_len), generator=generator)
                training.train_step(tokens[:sequences], tokens[:sequences])
                training.optimizer_step(optimizer)
                optimizer.zero_grad(set_to_none=True)

            # The first step creates the optimizer states and lets the pipeline schedule infer its
            # shapes (its autograd.grad probe clashes with MemTracker's hooks); the second is measured.
            # The first measures nothing, so it runs one sequence per micro-batch (the micro-batch count, and
            # under pipelining the shapes, stay the step's); it draws the whole batch, so the measured step's
            # tokens are the same (its weights, one AdamW step on fewer tokens, are not: the expert-parallel
            # configurations' ACT moved by under 1 %, the others' bytes not at all).
            step(local // job.train.micro_batch)
            if not track:
                step()
                return {}
            tracker = _step_tracker()
            tracker.track_external(*training.model_parts, optimizer)
            rows: list[int] = []
            with tracker, _counting_expert_rows(rows):
                step()
            snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    finally:
        setattr(ParallelDims, "build_mesh", original_mesh)
    named = {str(getattr(key, "name", key)): float(value) for key, value in snapshot.items()}
    out = {c: named.get(c, 0.0) for c in CATEGORIES}
    out["PARAM"] += named.get("BUFFER", 0.0)
    out["TEMP"] += named.get("OTH", 0.0)
    out["Total"] = sum(out[c] for c in CATEGORIES)
    moe = job.model.moe
    if rows and moe is not None and job.parallel.ep > 1:
        # The load of this rank's experts: rows they computed over the mean (tokens x top_k of one rank).
        mean_rows = job.train.micro_batch * job.model.seq_len // job.parallel.cp * moe.top_k
        out["expert load"] = sum(rows) / len(rows) / mean_rows
        out["expert load max"] = max(rows) / mean_rows
    return out


@contextlib.contextmanager
def _counting_expert_rows(rows: list[int]) -> Iterator[None]:
    """Record the rows each forward of a rank's local experts computes (not the recomputation inside
    backward), to report the load the measured rank had beside the planner's expert_load_imbalance."""
    from hpctrain.runtime.model import moe as moe_module

    original = moe_module.GroupedExperts.forward

    def forward(self: Any, x: Any, counts: Any) -> Any:
        if not moe_module._in_backward():
            rows.append(int(x.shape[0]))
        return original(self, x, counts)

    with patched({(moe_module.GroupedExperts, "forward"): forward}):
        yield


def _with_fake_group(world: int, fn: Any) -> Any:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world == 1:
        return fn()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return fn()
    finally:
        dist.destroy_process_group()
        # DTensor's sharding-propagation cache (C++) outlives the group: it compares meshes by layout, ranks and dim
        # names, not by their process groups, so a later configuration's tp mesh hit a destroyed group's entry and its
        # embedding weight came out on the old mesh ("Could not resolve the process group registered under the name
        # 7": tp2 dp2 zero2, then cp2 tp2 sp in the same process). Emptied here, configurations can share a process.
        torch._C._clear_DTensor_sharding_propagator_cache()


def _gloo_worker(rank: int, world: int, port: int, configs: list[Config], results: Any) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    import traceback

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for index, cfg in enumerate(configs):
            # One rank's measurement is read: the others run the same steps without MemTracker's hooks, which
            # change no value and no collective (measured: 4 of the 4-rank MoE configurations 41.1 -> 37.4 s).
            ranks_per_stage = world // cfg.job().parallel.pp
            measured_rank = rank // ranks_per_stage == cfg.pp_rank and rank % ranks_per_stage == 0
            measured = _measure_here(cfg, fake=False, track=measured_rank)
            if measured_rank:
                results.put((index, measured))
            dist.barrier()
    except BaseException:
        results.put((-1, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _world(cfg: Config) -> int:
    p = cfg.job().parallel
    return int(p.pp * p.tp * p.dp * p.cp)


def _measure_gloo(configs: list[Config]) -> list[dict[str, float]]:
    """Configurations of one world size in one gloo group (one process per rank)."""
    from hpctrain.rundir.ports import free_port

    worlds = {_world(c) for c in configs}
    if len(worlds) != 1:
        raise ValueError("gloo configurations must share one world size")
    world = worlds.pop()
    port = free_port()  # below the ephemeral range, where no client socket can take it first (rundir/ports.py)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, configs, results)) for r in range(world)]
    for proc in procs:
        proc.start()
    found: dict[int, Any] = {}
    try:
        while len(found) < len(configs):
            index, value = results.get(timeout=600)
            if index < 0:
                raise RuntimeError(f"a gloo rank failed:\n{value}")
            found[index] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [found[i] for i in range(len(configs))]


def _measure_in_process(cfg: Config) -> dict[str, float]:
    """One fake- or real-tensor configuration, measured in this process (one thread)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    job = cfg.job()
    world = job.parallel.tp * job.parallel.pp * job.parallel.dp * job.parallel.cp
    return _with_fake_group(world, lambda: _measure_here(cfg, fake=cfg.kind == "fake"))


def measure_all(configs: list[Config]) -> list[dict[str, float]]:
    """Measured bytes per category for each configuration (in order). The fake- and real-tensor
    configurations are independent single-process measurements (MemTracker counts tensors, not
    the process's memory), so they are spread over spawned workers, one per core; the gloo ones
    run as one multi-process group."""
    out: dict[int, dict[str, float]] = {}
    local = [i for i, cfg in enumerate(configs) if cfg.kind in ("fake", "real")]
    if local:
        workers = max(1, min(len(local), os.cpu_count() or 1))
        # Long-lived workers (a spawned process pays torch's import, seconds, per start), the context-parallel
        # configurations included (_with_fake_group empties what a measurement leaves in torch's caches).
        with mp.get_context("spawn").Pool(workers) as pool:
            for index, value in zip(local, pool.map(_measure_in_process, [configs[i] for i in local], chunksize=1)):
                out[index] = value
    gloo = [i for i, cfg in enumerate(configs) if cfg.kind == "gloo"]
    for world in sorted({_world(configs[i]) for i in gloo}):  # one group per world size, one after the other
        group = [i for i in gloo if _world(configs[i]) == world]
        for index, value in zip(group, _measure_gloo([configs[i] for i in group])):
            out[index] = value
    return [out[i] for i in range(len(configs))]


def check(predicted: dict[str, float], measured: dict[str, float]) -> dict[str, tuple[float, bool]]:
    """Per category and total: (relative error, within tolerance). The allowed error is
    TOLERANCE of the measured value, but at least SMALL_SHARE of the measured total."""
    total = measured["Total"]
    out = {}
    for key in (*CATEGORIES, "Total"):
        allowed = max(TOLERANCE * measured[key], SMALL_SHARE * total)
        diff = predicted[key] - measured[key]
        relative = diff / measured[key] if measured[key] else (0.0 if not diff else float("inf"))
        out[key] = (relative, abs(diff) <= allowed)
    return out


def main(argv: list[str] | None = None) -> int:
    from tabulate import tabulate

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two configurations of each kind")
    parser.add_argument("--only", default=None, help="configurations whose name contains this text")
    args = parser.parse_args(argv)
    configs = CONFIGS if args.only is None else [c for c in CONFIGS if args.only in c.name]
    if args.quick:
        configs = [c for kind in ("fake", "real", "gloo") for c in [x for x in CONFIGS if x.kind == kind][:2]]
    measured = measure_all(configs)
    rows, failures = [], 0
    for cfg, meas in zip(configs, measured):
        result = check(predict(cfg), meas)
        pred = predict(cfg)
        failures += sum(not ok for _, ok in result.values())
        rows.append([cfg.name] + [f"{pred[k] / 2**20:,.1f} / {meas[k] / 2**20:,.1f} ({result[k][0]:+.1%})"
                                  + ("" if result[k][1] else " !") for k in (*CATEGORIES, "Total")])
    print(tabulate(rows, headers=["planner / MemTracker MiB (error)", *CATEGORIES, "Total"]))
    loads = [f"{cfg.name}: mean {meas['expert load']:.3f}, max {meas['expert load max']:.3f}"
             for cfg, meas in zip(configs, measured) if "expert load" in meas]
    if loads:
        print("\nmeasured rank's expert load (rows its experts computed / tokens x top_k; the planner assumes "
              "1.0):\n  " + "\n  ".join(loads))
    print(f"\n{len(configs)} configurations, {failures} values outside tolerance (!): +-{TOLERANCE:.0%} of the "
          f"measured value, at least +-{SMALL_SHARE:.0%} of the measured total")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
