"""The whole checkpoint save at 2 ranks against a bare `dcp.save` of the same state (issue 12).

    OMP_NUM_THREADS=1 python bench/checkpoint_io.py --ranks 2 [--reps 7] [--dir DIR]

Two gloo processes hold the runtime's own model (dp=2, FSDP2 zero 3, AdamW, one step taken so the
optimizer state exists; ~5.4M parameters, fp32, the size the issue compared with torchtitan).
Alternating, `--reps` times each, on the same disk:

  bare   dcp.save(state) of the state dict `Checkpointer.save` builds, collection paused
         (gc.disable), nothing else: the floor
  save   what the training loop does: gc.collect() before, then Checkpointer.save with collection
         paused (barrier, RNG files, DCP): the time training stands still for the save
  finalize  then `Checkpointer.wait()` at once: the rest of that save (sha256 of every file,
         manifest, metadata, fsyncs, rename, prune), which runs in a thread while training goes on
         (runtime/checkpoint/checkpointer.py); timed apart, never overlapping the next measurement

Each figure is the slowest rank's; the medians and their ratio are printed. Goal: save <= 1.15 x bare.
"""

from __future__ import annotations

import gc
import os
import queue
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

GOAL = 1.15
MODEL = dict(layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=768, vocab=8192, seq_len=64,
             activation="swiglu", tie_embeddings=False)


def _job(folder: Path) -> Any:
    from hpctrain.config import job_from_dict

    return job_from_dict({
        "name": "ckpt-bench", "model": {"preset": None, **MODEL},
        "train": {"global_batch": 4, "micro_batch": 2, "precision": "fp32", "activation_checkpointing": "none",
                  "optimizer": {"name": "adamw"}},
        "parallel": {"tp": 1, "pp": 1, "dp": 2, "zero": 3, "schedule": "1f1b", "virtual_stages": 1},
        "placement": {"stage_layers": [], "rank_order": None},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 2},
        "checkpoint": {"dir": str(folder / "ckpt"), "every_steps": 1, "keep_last": 1},
    })


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank: int, world: int, port: int, folder: str, reps: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hpctrain.runtime.checkpoint.checkpointer import Checkpointer
    from hpctrain.runtime.optim import build_optimizers
    from hpctrain.runtime.parallel.build import build_training

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    job = _job(Path(folder))
    training = build_training(job, torch.device("cpu"))
    optimizers, _ = build_optimizers(job, training.model_parts)
    tokens = torch.randint(0, MODEL["vocab"], (2, MODEL["seq_len"] + 1), generator=torch.Generator().manual_seed(rank))
    training.train_step(tokens[:, :-1], tokens[:, 1:])
    optimizers.step()
    ckpt = Checkpointer(job, folder, training.model_parts, optimizers)
    state = ckpt._merge(ckpt._per_part())
    times: dict[str, list[float]] = {"bare": [], "save": [], "finalize": []}
    for rep in range(reps + 1):  # the first of each is a warm-up, not counted
        for kind in ("bare", "save") if rep % 2 else ("save", "bare"):
            gc.collect()
            dist.barrier()
            gc.disable()
            start = time.perf_counter()
            if kind == "bare":
                dcp.save(state, checkpoint_id=os.path.join(folder, f"bare-{rep}"))
            else:
                ckpt.save(rep + 1, {"bench": True})
            elapsed = _slowest(time.perf_counter() - start)
            if kind == "save":
                start = time.perf_counter()
                ckpt.wait()  # the background finalize, timed apart
                finalize = _slowest(time.perf_counter() - start)
                if rep:
                    times["finalize"].append(finalize)
            gc.enable()
            if rank == 0:
                shutil.rmtree(os.path.join(folder, f"bare-{rep}"), ignore_errors=True)
            if rep:
                times[kind].append(elapsed)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def run(work: Path, reps: int, ranks: int = 2) -> dict[str, list[float]]:
    import multiprocessing as mp

    from hpctrain.rundir.ports import free_port

    port = free_port()  # below the ephemeral range (rundir/ports.py)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, ranks, port, str(work), reps, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    while True:  # a rank that fails ends the bench instead of leaving it waiting
        try:
            times = out.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed (its traceback is above)")
    for p in procs:
        p.join()
    return times


def report(times: dict[str, list[float]]) -> bool:
    bare, save = statistics.median(times["bare"]), statistics.median(times["save"])
    ratio = save / bare
    print(f"checkpoint save at 2 ranks ({len(times['save'])} alternating repetitions, slowest rank, median)")
    for kind in ("bare", "save", "finalize"):
        runs = " ".join(f"{t:.3f}" for t in times[kind])
        print(f"  {kind:8} {statistics.median(times[kind]):.3f} s   runs: {runs}")
    print("  (save: how long training stands still; finalize: the rest, in a thread while training goes on)")
    print(f"  save / bare dcp.save = {ratio:.2f}x   goal <= {GOAL:.2f}x: {'ok' if ratio <= GOAL else 'MISSED'}")
    return ratio <= GOAL
