#!/usr/bin/env python3
"""hpctrain's runtime against torchtitan, side by side, on the same CPU with gloo.

The same Llama (4 layers, hidden 256, 8 heads, SwiGLU 768, vocab 1024, untied head: 3,934,464
parameters on both sides, printed), the same global batch and sequence length, fp32, no activation
checkpointing, no compile, AdamW with linear warm-up, one micro-batch per step, OMP_NUM_THREADS=1 and
glibc's malloc thresholds fixed for both sides (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ =
4 GiB, as bench/runtime_overhead.py explains). Layouts: 1 process, dp2 (hpctrain zero 3 = FSDP2
resharding after forward, torchtitan's FSDP2 default for dp_shard=2) and tp2 (each side's own
tensor + sequence parallelism: hpctrain parallel.sequence_parallel true, torchtitan's default
enable_sequence_parallel; both with loss parallel). Each layout runs hpctrain and torchtitan in turn, --runs pairs,
every run a fresh set of processes; medians and the median of the pairwise ratios are printed.

Figures, the same definition on both sides, from rank 0's step timestamps (hpctrain: the `time`
of each metrics.jsonl line, written when the step is logged; torchtitan: time.time() when
Trainer.train_step returns, where it logs):
- tokens/s: global batch x seq_len over the median interval between consecutive steps after
  step --warmup (robust to another process taking the cores for a moment, on a shared machine);
  "wall tok/s": (steps - warmup) x global batch x seq_len over the wall clock from the end of step
  --warmup to the end of the last step;
- first step: from starting the processes to the end of step 1 (imports, process group, build,
  init, the first step);
- peak RSS: the largest ru_maxrss among the ranks (os.wait4);
- checkpoint pause (own rows, 1 process and dp2): a checkpoint is saved after step --ckpt-step
  (hpctrain checkpoint.every_steps, sync; torchtitan checkpoint.interval, its default
  async_mode "disabled"); the pause is the interval that holds the save minus the median interval
  of the steps away from it; "after" is the excess time of the 3 steps that follow (work the save
  left running in threads, competing for the cores). "save timer" is each side's own clock on the
  save call (torchtitan: around CheckpointManager.save, its GC included; hpctrain: the `checkpoint
  saved` event's blocking_s, without the trainer's gc.collect() just before the save), for reference.

torchtitan: --torchtitan DIR names a directory holding the `torchtitan/` package, outside this
repository (a checkout's root, or the 0.3.0 wheel unpacked: `pip download --no-deps
torchtitan==0.3.0` then unzip). Its Python imports must be installed in the same venv (with torch
pinned): `pip install -c <(echo torch==2.13.0) spmd_types==0.2.3 torch_checkpointing tyro tokenizers
torchdata einops pillow safetensors "datasets>=3.6,<4.8"` (datasets < 4.8 wants huggingface-hub < 2 and pip
downgrades it, which breaks transformers' >= 2.4 in a shared venv: reinstall `huggingface-hub>=2.4` after it, or give
torchtitan a venv of its own). It runs through
bench/_torchtitan_worker.py, whose docstring lists every patch it makes around torchtitan's Trainer
(device "cpu", gloo, no triton, memory monitor, set_pg_timeouts' barrier, a synthetic loader).
Without --torchtitan only hpctrain's side runs, and the table says the torchtitan side was skipped.

    python bench/torchtitan_compare.py --torchtitan /path/to/torchtitan --runs 5
    python bench/torchtitan_compare.py --torchtitan DIR --layouts tp2 --runs 7
    python bench/torchtitan_compare.py --torchtitan DIR --layouts ckpt-1 --runs 5
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

from runtime_overhead import free_port, rank_env  # bench/ is on sys.path: python bench/X.py

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "bench", "_torchtitan_worker.py")
MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 8, "ffn_hidden": 768, "vocab": 1024, "seq_len": 128,
         "activation": "swiglu"}
LAYOUTS = {  # name: (tp, dp, checkpoint)
    "1": (1, 1, False), "dp2": (1, 2, False), "tp2": (2, 1, False), "ckpt-1": (1, 1, True), "ckpt-dp2": (1, 2, True),
}
AFTER_STEPS = 3


def hpctrain_job(tp: int, dp: int, steps: int, global_batch: int, ckpt_step: int | None) -> dict[str, Any]:
    return {
        "name": "titan-compare",
        "model": MODEL,
        "train": {"global_batch": global_batch, "micro_batch": global_batch // dp, "steps": steps,
                  "precision": "fp32", "activation_checkpointing": "none", "log_every": 1, "data": "synthetic",
                  "optimizer": {"lr": 1e-3, "weight_decay": 0.1}, "lr_schedule": {"warmup_steps": 2}},
        "parallel": {"tp": tp, "pp": 1, "dp": dp, "zero": 3 if dp > 1 else 1, "schedule": "1f1b",
                     "virtual_stages": 1, "sequence_parallel": tp > 1},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": tp * dp, "gpu": "cpu"},
        "checkpoint": {"every_steps": ckpt_step or steps + 1000, "keep_last": 2},
    }


def launch(argvs: list[list[str]], envs: list[dict[str, str]], cwd: str, log_dir: str,
           timeout_s: float) -> tuple[float, float]:
    """Start one process per rank; wait for all. (start time.time(), peak ru_maxrss MiB over ranks)."""
    logs = [open(os.path.join(log_dir, f"rank-{r}.log"), "w") for r in range(len(argvs))]
    start = time.time()
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
             for argv, env, log in zip(argvs, envs, logs)]
    deadline = time.monotonic() + timeout_s
    rss, codes = 0.0, {}
    try:
        while len(codes) < len(procs):
            for proc in procs:
                if proc.pid in codes:
                    continue
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    codes[proc.pid] = os.waitstatus_to_exitcode(status)
                    proc.returncode = codes[proc.pid]
                    rss = max(rss, usage.ru_maxrss / 1024)
                    if codes[proc.pid]:
                        deadline = min(deadline, time.monotonic() + 20)
            if time.monotonic() > deadline:
                raise TimeoutError("timed out")
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    if any(codes.values()):
        with open(os.path.join(log_dir, "rank-0.log")) as handle:
            tail = handle.read()[-3000:]
        raise RuntimeError(f"exit codes {list(codes.values())}; rank 0 log ({log_dir}):\n{tail}")
    return start, rss


def run_hpctrain(tp: int, dp: int, args: argparse.Namespace, ckpt_step: int | None, workdir: str) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="hpctrain-")
    path = run_dir + ".yaml"
    with open(path, "w") as handle:
        yaml.safe_dump(hpctrain_job(tp, dp, args.steps, args.global_batch, ckpt_step), handle)
    world, port = tp * dp, free_port()
    argv = [sys.executable, "-m", "hpctrain.runtime", "--job", path, "--run-dir", run_dir]
    start, rss = launch([argv] * world, [rank_env(world, r, port, False) for r in range(world)], REPO, run_dir,
                        args.timeout)
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        times = [float(json.loads(line)["time"]) for line in handle]
    with open(os.path.join(run_dir, "events.jsonl")) as handle:
        events = [json.loads(line) for line in handle if line.strip()]
    saves = [float(e["blocking_s"]) for e in events if e.get("event") == "checkpoint saved" and e.get("step") == ckpt_step]
    return {"start": start, "rss_mib": rss, "times": times, "save_s": saves}


def run_torchtitan(tp: int, dp: int, args: argparse.Namespace, ckpt_step: int | None, workdir: str) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="torchtitan-")
    spec = {"model": MODEL, "local_batch": args.global_batch // dp, "steps": args.steps, "tp": tp, "dp": dp,
            "checkpoint_every": ckpt_step or 0, "dump_folder": os.path.join(run_dir, "dump"),
            "out": os.path.join(run_dir, "out.json")}
    path = os.path.join(run_dir, "spec.json")
    with open(path, "w") as handle:
        json.dump(spec, handle)
    world, port = tp * dp, free_port()
    argv = [sys.executable, WORKER, os.path.abspath(args.torchtitan), path]
    start, rss = launch([argv] * world, [rank_env(world, r, port, True) for r in range(world)], run_dir, run_dir,
                        args.timeout)
    with open(spec["out"]) as handle:
        out = json.load(handle)
    return {"start": start, "rss_mib": rss, "times": [s["time"] for s in out["steps"]],
            "save_s": out["saves_s"], "params": out["local_params"]}


def figures(run: dict[str, Any], args: argparse.Namespace, ckpt_step: int | None) -> dict[str, float]:
    t, w = run["times"], args.warmup
    got = {"first_step_s": t[0] - run["start"], "rss_mib": run["rss_mib"]}
    intervals = {k + 1: t[k] - t[k - 1] for k in range(1, len(t))}  # step number -> its interval
    if ckpt_step is None:
        got["tokens_per_s"] = args.global_batch * MODEL["seq_len"] / statistics.median(
            d for k, d in intervals.items() if k > w)
        got["wall_tokens_per_s"] = (len(t) - w) * args.global_batch * MODEL["seq_len"] / (t[-1] - t[w - 1])
    else:
        near = set(range(ckpt_step + 1, ckpt_step + 2 + AFTER_STEPS))
        base = statistics.median(d for k, d in intervals.items() if k > w and k not in near)
        got["pause_s"] = intervals[ckpt_step + 1] - base
        got["after_s"] = sum(intervals[k] - base for k in range(ckpt_step + 2, ckpt_step + 2 + AFTER_STEPS))
        got["step_s"] = base
        if run.get("save_s"):
            got["save_timer_s"] = run["save_s"][0]
    return got


def row(name: str, a: list[float], b: list[float], fmt: str, skipped: bool) -> str:
    ma = statistics.median(a)
    if skipped:
        return f"  {name:<16}{ma:>12{fmt}}{'skipped':>12}{'':>9}"
    mb = statistics.median(b)
    if name == "ckpt after s":  # near zero, either sign: a difference says more than a ratio
        diff = statistics.median(x - y for x, y in zip(a, b))
        return f"  {name:<16}{ma:>12{fmt}}{mb:>12{fmt}}{diff:>+9.3f}   (median pairwise difference, s)"
    ratio = statistics.median(x / y for x, y in zip(a, b) if y)
    wins = sum(x > y for x, y in zip(a, b))
    return f"  {name:<16}{ma:>12{fmt}}{mb:>12{fmt}}{ratio:>9.3f}   (hpctrain higher in {wins}/{len(a)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torchtitan", help="directory holding the torchtitan package (outside this repo)")
    parser.add_argument("--layouts", default="1,dp2,tp2,ckpt-1", help=f"comma-separated, of {list(LAYOUTS)}")
    parser.add_argument("--runs", type=int, default=3, help="pairs per layout")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--ckpt-step", type=int, default=10, help="the step after which the checkpoint rows save")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    args = parser.parse_args()
    skipped = not args.torchtitan
    if not skipped and not os.path.isfile(os.path.join(args.torchtitan, "torchtitan", "train.py")):
        parser.error(f"--torchtitan {args.torchtitan}: no torchtitan/train.py there")
    workdir = tempfile.mkdtemp(prefix="titan-compare-")
    print(f"model {MODEL}, global batch {args.global_batch} x seq {MODEL['seq_len']}, fp32, gloo, "
          f"{args.steps} steps (tokens/s over steps {args.warmup + 1}-{args.steps}), {args.runs} interleaved pairs"
          + ("" if not skipped else "\nTORCHTITAN SIDE SKIPPED: no --torchtitan DIR given; hpctrain's figures only"))
    results: dict[str, dict[str, dict[str, list[float]]]] = {}
    for layout in args.layouts.split(","):
        tp, dp, ckpt = LAYOUTS[layout]
        ckpt_step = args.ckpt_step if ckpt else None
        sides: dict[str, dict[str, list[float]]] = {"hpctrain": {}, "torchtitan": {}}
        for i in range(args.runs):
            order = ["hpctrain", "torchtitan"] if i % 2 == 0 else ["torchtitan", "hpctrain"]
            for side in order:
                if side == "torchtitan" and skipped:
                    continue
                runner = run_hpctrain if side == "hpctrain" else run_torchtitan
                got = runner(tp, dp, args, ckpt_step, workdir)
                if side == "torchtitan" and i == 0 and layout == args.layouts.split(",")[0]:
                    print(f"  torchtitan parameters on rank 0: {got['params']:,}")
                for key, value in figures(got, args, ckpt_step).items():
                    sides[side].setdefault(key, []).append(value)
            line = "   ".join(f"{s}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in f.items()) for s, f in sides.items() if f)
            print(f"  [{layout} pair {i + 1}] {line}", flush=True)
        results[layout] = sides
    print(f"\n  {'':<16}{'hpctrain':>12}{'torchtitan':>12}{'ratio':>9}   (median of pairwise hpctrain/torchtitan)")
    labels = {"tokens_per_s": ("tokens/s", ",.0f"), "wall_tokens_per_s": ("wall tok/s", ",.0f"), "first_step_s": ("first step s", ".2f"),
              "rss_mib": ("peak RSS MiB", ",.0f"), "pause_s": ("ckpt pause s", ".3f"),
              "after_s": ("ckpt after s", ".3f"), "save_timer_s": ("save timer s", ".3f"), "step_s": ("step s", ".3f")}
    for layout, sides in results.items():
        print(f"  {layout}")
        for key, values in sides["hpctrain"].items():
            name, fmt = labels[key]
            print(row(name, values, sides["torchtitan"].get(key, []), fmt, skipped))
    if not args.keep:
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
