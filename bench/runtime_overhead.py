#!/usr/bin/env python3
"""What does hpctrain's runtime cost over a plain PyTorch loop, and how does it scale?

Part 1 (the goal: >= 0.95x). Tokens/s of `python -m hpctrain.runtime` at world size 1 against a
plain PyTorch loop over the same model (hpctrain's Transformer, same seed), the same batch and
precision, AdamW(foreach), clipping and the same LR schedule. Runs alternate runtime / plain, each in
a fresh process with OMP_NUM_THREADS=1; the median of --runs runs each is printed side by side.
Tokens/s is wall clock between the end of step --warmup and the end of the last step: the runtime
pays for everything its loop does there (synthetic data, telemetry, metrics lines), the plain loop
reuses pre-built batches and logs nothing. Checkpoints are off (every_steps > steps, no final save).
Both sides run with glibc's mmap and trim thresholds fixed (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ = 4 GiB): otherwise glibc's dynamic threshold decides the result - measured
here, the same plain loop ran at 6.4k tok/s by default and 11.1k with the thresholds fixed, because
large activation buffers were mmapped and page-faulted afresh every step.

Part 2. Tokens/s at 1, 2, 4 and 8 local processes (gloo on CPU) for DP, TP, PP and 3D with a fixed
global batch (strong scaling), with the mean time split of the ranks' summaries. On a machine with
fewer cores than processes these figures measure oversubscription as much as the runtime.

    python bench/runtime_overhead.py                 # both parts
    python bench/runtime_overhead.py --part 1 --runs 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = {"layers": 4, "hidden": 128, "heads": 8, "kv_heads": 8, "ffn_hidden": 384, "vocab": 256, "seq_len": 128,
         "activation": "swiglu"}
PART2_MODEL = {**MODEL, "layers": 8}
LAYOUTS = {  # (tp, pp, dp) per process count; 3D grows one dimension at a time
    "DP": {1: (1, 1, 1), 2: (1, 1, 2), 4: (1, 1, 4), 8: (1, 1, 8)},
    "TP": {1: (1, 1, 1), 2: (2, 1, 1), 4: (4, 1, 1), 8: (8, 1, 1)},
    "PP": {1: (1, 1, 1), 2: (1, 2, 1), 4: (1, 4, 1), 8: (1, 8, 1)},
    "3D": {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 1, 2), 8: (2, 2, 2)},
}


def make_job(model: dict[str, Any], tp: int, pp: int, dp: int, steps: int, global_batch: int,
             micro_batch: int, precision: str) -> dict[str, Any]:
    return {
        "name": "runtime-overhead",
        "model": model,
        "train": {"global_batch": global_batch, "micro_batch": micro_batch, "steps": steps, "precision": precision,
                  "activation_checkpointing": "none", "log_every": 1, "data": "synthetic",
                  "optimizer": {"lr": 1e-3, "weight_decay": 0.1}, "lr_schedule": {"warmup_steps": 2}},
        "parallel": {"tp": tp, "pp": pp, "dp": dp, "zero": 1, "schedule": "1f1b", "virtual_stages": 1},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": tp * pp * dp, "gpu": "cpu"},
        "checkpoint": {"every_steps": steps + 1000, "keep_last": 1},
    }


def rank_env(world: int, rank: int, port: int, always_dist: bool = False) -> dict[str, str]:
    """One local rank's environment: torchrun's variables (or none, for a single process unless always_dist),
    one thread, no final checkpoint, glibc's malloc thresholds fixed (see the docstring)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", HPCTRAIN_FINAL_CHECKPOINT="0", MALLOC_MMAP_THRESHOLD_=str(4 << 30),
               MALLOC_TRIM_THRESHOLD_=str(4 << 30), PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""))
    if world > 1 or always_dist:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    else:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
    return env


def free_port() -> int:
    """A rendezvous port below the ephemeral range (rundir/ports.py)."""
    from hpctrain.rundir.ports import free_port as pick

    return pick()


def run_runtime(job: dict[str, Any], workdir: str, warmup: int, timeout_s: float = 900) -> dict[str, Any] | None:
    """Launch the job on tp*pp*dp local processes; tokens/s over steps warmup+1..N, wall clock.
    None when it did not finish within timeout_s."""
    p = job["parallel"]
    world = p["tp"] * p["pp"] * p["dp"]
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="run-")
    path = os.path.join(run_dir + ".yaml")
    with open(path, "w") as handle:
        yaml.safe_dump(job, handle)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "hpctrain.runtime", "--job", path, "--run-dir", run_dir],
                              env=rank_env(world, rank, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              cwd=REPO, text=True) for rank in range(world)]
    deadline = time.monotonic() + timeout_s
    try:
        errors = [proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[1] for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        return None
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"runtime failed ({[p.returncode for p in procs]}):\n" + "\n".join(errors)[-3000:])
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    first, last = lines[warmup - 1], lines[-1]
    ranks = []
    for rank in range(world):
        with open(os.path.join(run_dir, "ranks", f"rank-{rank}.json")) as handle:
            ranks.append(json.load(handle))
    split = {k: statistics.mean(r[k] for r in ranks) for k in
             ("step_time_s", "time_compute_s", "time_comm_exposed_s", "time_bubble_s")}
    return {"tokens_per_s": (last["tokens"] - first["tokens"]) / (last["time"] - first["time"]),
            "loss": last["loss"], **split}


def plain_worker(job_path: str, out_path: str, warmup: int) -> None:
    """The baseline: a plain PyTorch loop over the same model, batch, precision and optimizer."""
    import torch
    import torch.nn.functional as F

    from hpctrain.config import load_job
    from hpctrain.runtime.data.tokens import SyntheticTokens
    from hpctrain.runtime.model.transformer import ModelArgs, build_model
    from hpctrain.runtime.optim import LRLambda

    torch.set_num_threads(1)
    job = load_job(job_path)
    t, args = job.train, ModelArgs.from_config(job.model)
    model = build_model(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(t.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.optimizer.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.optimizer.lr, betas=(t.optimizer.betas[0], t.optimizer.betas[1]), foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LRLambda(t.lr_schedule.kind, t.lr_schedule.warmup_steps,
                                                           t.steps, t.lr_schedule.min_lr_ratio))
    source = SyntheticTokens(args.vocab, args.seq_len, t.seed)
    batches = [torch.from_numpy(source.samples(i * t.global_batch, t.global_batch)) for i in range(4)]
    n_micro = t.global_batch // t.micro_batch
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    start = 0.0
    for step in range(1, t.steps + 1):
        tokens = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for chunk in tokens.chunk(n_micro):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), chunk[:, 1:].flatten())
            (loss / n_micro).backward()
            total += float(loss.detach()) / n_micro
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.optimizer.grad_clip or float("inf"), foreach=True)
        opt.step()
        sched.step()
        if step == warmup:
            start = time.perf_counter()
    elapsed = time.perf_counter() - start
    with open(out_path, "w") as handle:
        json.dump({"tokens_per_s": (t.steps - warmup) * t.global_batch * args.seq_len / elapsed, "loss": total},
                  handle)


def run_plain(job: dict[str, Any], workdir: str, warmup: int) -> dict[str, Any]:
    fd, path = tempfile.mkstemp(dir=workdir, suffix=".yaml")
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(job, handle)
    out = path + ".json"
    subprocess.run([sys.executable, os.path.abspath(__file__), "--plain-worker", path, out, str(warmup)],
                   env=rank_env(1, 0, 0), check=True, cwd=REPO)
    with open(out) as handle:
        return json.load(handle)


def part1(args: argparse.Namespace, workdir: str) -> None:
    job = make_job(MODEL, 1, 1, 1, args.steps, args.global_batch, args.global_batch, args.precision)
    print(f"Part 1: world size 1, model {MODEL}, global batch {args.global_batch} x seq {MODEL['seq_len']}, "
          f"{args.precision}, {args.steps} steps (tokens/s over steps {args.warmup + 1}-{args.steps}), "
          f"{args.runs} runs each, alternating")
    rt, plain = [], []
    for i in range(args.runs):
        got = run_runtime(job, workdir, args.warmup)
        if got is None:
            raise RuntimeError("the runtime did not finish within 900 s")
        rt.append(got["tokens_per_s"])
        plain.append(run_plain(job, workdir, args.warmup)["tokens_per_s"])
        print(f"  run {i + 1}: runtime {rt[-1]:9,.0f} tok/s   plain {plain[-1]:9,.0f} tok/s", flush=True)
    a, b = statistics.median(rt), statistics.median(plain)
    print(f"{'':2}{'':22}{'median tok/s':>14}{'min':>10}{'max':>10}")
    print(f"  {'python -m hpctrain.runtime':<22}{a:>14,.0f}{min(rt):>10,.0f}{max(rt):>10,.0f}")
    print(f"  {'plain PyTorch loop':<22}{b:>14,.0f}{min(plain):>10,.0f}{max(plain):>10,.0f}")
    verdict = "meets" if a / b >= 0.95 else "MISSES"
    print(f"  ratio runtime/plain = {a / b:.3f} ({verdict} the 0.95 goal)\n", flush=True)


def part2(args: argparse.Namespace, workdir: str) -> None:
    gb = 16
    steps, warmup = args.scaling_steps, min(args.warmup, args.scaling_steps - 2)
    print(f"Part 2: strong scaling, model {PART2_MODEL}, global batch {gb}, micro-batch 2, {args.precision}, "
          f"gloo on {os.cpu_count()} CPU cores, {steps} steps (tokens/s over steps {warmup + 1}-{steps}), one run each")
    print(f"  {'mode':<5}{'procs':>6}{'(tp,pp,dp)':>12}{'tok/s':>10}{'vs 1':>7}{'step ms':>9}{'compute':>9}"
          f"{'comm':>8}{'bubble':>8}")
    base: float | None = None
    cache: dict[tuple[int, int, int], dict[str, Any] | None] = {}
    for mode, sizes in LAYOUTS.items():
        for n in args.procs:
            layout = sizes[n]
            if layout not in cache:
                job = make_job(PART2_MODEL, *layout, steps, gb, 2, args.precision)
                cache[layout] = run_runtime(job, workdir, warmup, args.scaling_timeout_s)
            r = cache[layout]
            if r is None:
                print(f"  {mode:<5}{n:>6}{str(layout):>12}  did not finish in {args.scaling_timeout_s:.0f} s", flush=True)
                continue
            base = base or r["tokens_per_s"]
            ms = {k: 1e3 * r[k] for k in ("step_time_s", "time_compute_s", "time_comm_exposed_s", "time_bubble_s")}
            print(f"  {mode:<5}{n:>6}{str(layout):>12}{r['tokens_per_s']:>10,.0f}{r['tokens_per_s'] / base:>7.2f}"
                  f"{ms['step_time_s']:>9.1f}{ms['time_compute_s']:>9.1f}{ms['time_comm_exposed_s']:>8.1f}"
                  f"{ms['time_bubble_s']:>8.1f}", flush=True)
    print("  (compute/comm/bubble: mean over ranks of ranks/rank-R.json, ms per step; comm and bubble are "
          "measured host-blocked waits, compute is the rest)")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--plain-worker":
        plain_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=["1", "2", "all"], default="all")
    parser.add_argument("--runs", type=int, default=5, help="runs of each side in part 1 (median; >= 5)")
    parser.add_argument("--steps", type=int, default=30, help="steps per run in part 1")
    parser.add_argument("--scaling-steps", type=int, default=10, help="steps per run in part 2")
    parser.add_argument("--scaling-timeout-s", type=float, default=300, help="per run in part 2")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from tokens/s")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4, 8], choices=[1, 2, 4, 8])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-") as workdir:
        if args.part in ("1", "all"):
            part1(args, workdir)
        if args.part in ("2", "all"):
            part2(args, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
