#!/usr/bin/env python3
"""Tokens/s, MFU and peak memory of `python -m hpctrain.runtime` on ONE GPU, against the planner.

The model is preset llama3-1b (1.24 B parameters, vocab 128256, GQA 32/8 heads) with a shorter
sequence (default 2048), bf16 autocast over fp32 master weights, SDPA attention, AdamW, no
activation checkpointing (so MFU counts no recompute). For each micro-batch the planner is asked
for its prediction of exactly that configuration (`hpctrain.plan.plan_job` with tp=pp=dp=1 and the
micro-batch fixed); the runs start at the largest micro-batch the planner says fits, try one size
larger (is the planner conservative?) and step down on out-of-memory, at most --max-runs runs.
Each run has global batch = 4 micro-batches and --steps steps; tokens/s is wall clock over the
steps after --warmup (from metrics.jsonl), MFU = flops_per_token(model, "none") x tokens/s / the
catalog's dense bf16 peak (h200-141gb: 989 TFLOP/s), peak memory = torch.cuda.max_memory_allocated.

Then, at that micro-batch, the precision/compile rows (--rows, default bf16, bf16+compile, fp8+compile:
`train.compile`, `train.precision: fp8` with torchao's tensorwise recipe, issue 27), each measured and
next to the planner's prediction of the same job. The planner prices fp8 as bf16 (plan/planner.py
`planned_precision`: its fp8 GEMM speed-up is the planner's precision dimension's), and compile as
eager: the measured/planner ratio of those rows is the speed-up the planner does not model yet.

Without CUDA it prints the planner's predictions and says the measurement was skipped (exit 0).

    python bench/gpu_mfu.py                      # one H200, ~3-5 minutes
    python bench/gpu_mfu.py --micro-batches 8 4 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
GIB = 2**30


ROWS = {"bf16": ("bf16", False), "bf16+compile": ("bf16", True), "fp8+compile": ("fp8", True), "fp8": ("fp8", False)}


def make_job(seq_len: int, micro_batch: int, steps: int, gpu: str, ac: str, row: str = "bf16") -> dict[str, Any]:
    precision, compile_ = ROWS[row]
    return {
        "name": f"gpu-mfu-mb{micro_batch}-{row.replace('+', '-')}",
        "model": {"preset": "llama3-1b", "seq_len": seq_len},
        "train": {"global_batch": 4 * micro_batch, "micro_batch": micro_batch, "steps": steps, "precision": precision,
                  "compile": compile_, "fp8": {"recipe": "tensorwise"},
                  "activation_checkpointing": ac, "log_every": 1, "data": "synthetic",
                  "optimizer": {"lr": 3e-4, "weight_decay": 0.1}, "lr_schedule": {"warmup_steps": 2}},
        "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 1, "schedule": "1f1b", "virtual_stages": 1},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": gpu},
        "checkpoint": {"every_steps": steps + 1000, "keep_last": 1},
    }


def predict(job_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The planner's figures for exactly this configuration, or None when it says it does not fit."""
    from hpctrain.config import job_from_dict
    from hpctrain.errors import PlanError
    from hpctrain.plan import plan_job

    try:
        result = plan_job(job_from_dict(job_dict))
    except PlanError:
        return None
    lay = result.best
    c = lay.cost
    return {"memory_bytes": lay.memory.total, "tokens_per_s": c.tokens_per_s, "mfu": c.mfu,
            "step_time_s": c.step_time_s, "budget_bytes": result.budget_bytes}


def measure(job_dict: dict[str, Any], workdir: str, warmup: int, timeout_s: int) -> dict[str, Any]:
    """Run the runtime on one GPU; {'oom': True} when it ran out of memory."""
    run_dir = tempfile.mkdtemp(dir=workdir, prefix="run-")
    path = run_dir + ".yaml"
    with open(path, "w") as handle:
        yaml.safe_dump(job_dict, handle)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env["HPCTRAIN_FINAL_CHECKPOINT"] = "0"  # no 15 GB checkpoint at the end
    env.setdefault("OMP_NUM_THREADS", "8")  # the weights are drawn on the CPU: do not do it on one thread
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hpctrain.runtime", "--job", path, "--run-dir", run_dir],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        if "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr:
            return {"oom": True, "wall_s": wall}
        raise RuntimeError(f"runtime exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as handle:
        lines = [json.loads(line) for line in handle]
    first, last = lines[warmup - 1], lines[-1]
    tokens_per_s = (last["tokens"] - first["tokens"]) / (last["time"] - first["time"])
    return {"oom": False, "wall_s": wall, "tokens_per_s": tokens_per_s,
            "mfu": last["mfu"] * tokens_per_s / last["tokens_per_s"] if last["mfu"] is not None else None,
            "tflops_per_gpu": last["tflops_per_gpu"] * tokens_per_s / last["tokens_per_s"],
            "peak_memory_bytes": max(m["peak_memory_bytes"] for m in lines), "loss": last["loss"],
            "step_time_s": sum(m["step_time_s"] for m in lines[warmup:]) / max(1, len(lines) - warmup)}


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _plan_table(preds: dict[int, dict[str, Any] | None], seq_len: int) -> None:
    print(f"  {'mb':>4}{'tokens/step':>12}{'pred mem GiB':>14}{'pred tok/s':>12}{'pred MFU':>10}")
    for mb, p in preds.items():
        if p is None:
            print(f"  {mb:>4}{4 * mb * seq_len:>12,}{'does not fit':>14}")
        else:
            print(f"  {mb:>4}{4 * mb * seq_len:>12,}{p['memory_bytes'] / GIB:>14.1f}{p['tokens_per_s']:>12,.0f}{p['mfu']:>10.1%}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[32, 16, 12, 8, 6, 4, 2, 1])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--ac", choices=["none", "selective", "full"], default="none")
    parser.add_argument("--gpu", default="h200-141gb", help="catalog name for the planner and the MFU peak")
    parser.add_argument("--max-runs", type=int, default=3)
    parser.add_argument("--timeout-s", type=int, default=300, help="per run")
    parser.add_argument("--rows", default="bf16,bf16+compile,fp8+compile",
                        help=f"comma-separated rows measured at the largest micro-batch that ran ({', '.join(ROWS)})")
    args = parser.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; known: {', '.join(ROWS)}")

    sizes = sorted(set(args.micro_batches), reverse=True)
    preds = {mb: predict(make_job(args.seq_len, mb, args.steps, args.gpu, args.ac)) for mb in sizes}
    print(f"llama3-1b, seq {args.seq_len}, bf16, SDPA, ac={args.ac}, AdamW, 1 x {args.gpu}; global batch = 4 x mb")
    print("Planner predictions:")
    _plan_table(preds, args.seq_len)

    import torch

    if not torch.cuda.is_available():
        mb = next((m for m in sizes if preds[m] is not None), sizes[-1])
        print(f"\nPlanner predictions of the rows at mb={mb}:")
        for row in rows:
            p = predict(make_job(args.seq_len, mb, args.steps, args.gpu, args.ac, row))
            print(f"  {row:<14}" + ("does not fit" if p is None else f"{p['tokens_per_s']:>10,.0f} tok/s  "
                                    f"MFU {p['mfu']:.1%}  {p['memory_bytes'] / GIB:.1f} GiB"))
        print(f"\nbench/gpu_mfu.py: no CUDA device here (torch {torch.__version__}); measurement skipped. "
              "Run it on a machine with one GPU (it was prepared for one H200).")
        return 0
    print(f"\nMeasuring on {torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / GIB:.0f} GiB), "
          f"torch {torch.__version__}")
    fitting = [mb for mb in sizes if preds[mb] is not None]
    start = sizes.index(fitting[0]) if fitting else len(sizes) - 1
    index = max(0, start - 1)  # first one size above the planner's largest: is the planner conservative?
    best: tuple[int, dict[str, Any]] | None = None
    with tempfile.TemporaryDirectory(prefix="hpctrain-gpu-mfu-") as workdir:
        for _ in range(args.max_runs):  # descending: the first micro-batch that runs is the largest
            if index >= len(sizes):
                break
            mb = sizes[index]
            got = measure(make_job(args.seq_len, mb, args.steps, args.gpu, args.ac), workdir, args.warmup,
                          args.timeout_s)
            status = "out of memory" if got["oom"] else (f"{got['tokens_per_s']:,.0f} tok/s, MFU {_pct(got['mfu'])}, "
                                                         f"peak {got['peak_memory_bytes'] / GIB:.1f} GiB")
            print(f"  mb={mb}: {status} ({got['wall_s']:.0f} s incl. start-up)", flush=True)
            if not got["oom"]:
                best = (mb, got)
                break
            index += 1
    if best is None:
        print("No micro-batch fitted.")
        return 1
    mb, got = best
    pred = preds[mb]
    print(f"\nLargest micro-batch that ran: {mb} (global batch {4 * mb} x {args.seq_len} tokens)")
    print(f"  {'':<22}{'measured':>14}{'planner':>14}{'ratio':>8}")
    rows = [("tokens/s", got["tokens_per_s"], pred and pred["tokens_per_s"], "{:,.0f}"),
            ("MFU", got["mfu"], pred and pred["mfu"], "{:.1%}"),
            ("step time s", got["step_time_s"], pred and pred["step_time_s"], "{:.3f}"),
            ("peak memory GiB", got["peak_memory_bytes"] / GIB, pred and pred["memory_bytes"] / GIB, "{:.1f}")]
    for name, measured, predicted, fmt in rows:
        ratio = f"{measured / predicted:.2f}" if predicted and measured is not None else "-"
        shown = fmt.format(predicted) if predicted is not None else "n/a"
        print(f"  {name:<22}{fmt.format(measured) if measured is not None else 'n/a':>14}{shown:>14}{ratio:>8}")
    print(f"  TFLOP/s per GPU (hardware FLOPs): {got['tflops_per_gpu']:.0f}; final loss {got['loss']:.3f}")
    print("  (peak memory measured = torch.cuda.max_memory_allocated; the planner's figure includes its "
          "runtime overhead allowance)")
    _rows_table(args, rows, mb, got)
    return 0


def _rows_table(args: argparse.Namespace, rows: list[str], mb: int, bf16: dict[str, Any]) -> None:
    """Each row at micro-batch `mb`: measured against the planner's prediction of the same job."""
    print(f"\nPrecision / compile rows at mb={mb} (MFU against the bf16 peak, as torchtitan quotes fp8 runs):")
    print(f"  {'row':<14}{'tok/s':>10}{'planner':>10}{'ratio':>7}{'MFU':>8}{'planner':>9}{'peak GiB':>10}{'planner':>9}")
    with tempfile.TemporaryDirectory(prefix="hpctrain-gpu-mfu-rows-") as workdir:
        for row in rows:
            job = make_job(args.seq_len, mb, args.steps, args.gpu, args.ac, row)
            pred = predict(job)
            try:
                got = bf16 if row == "bf16" else measure(job, workdir, args.warmup, args.timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"  {row:<14}failed: {str(exc).splitlines()[0][:200]}")
                continue
            if got["oom"]:
                print(f"  {row:<14}out of memory")
                continue
            ratio = f"{got['tokens_per_s'] / pred['tokens_per_s']:.2f}" if pred else "-"
            print(f"  {row:<14}{got['tokens_per_s']:>10,.0f}{(pred['tokens_per_s'] if pred else 0):>10,.0f}{ratio:>7}"
                  f"{_pct(got['mfu']):>8}{_pct(pred['mfu'] if pred else None):>9}"
                  f"{got['peak_memory_bytes'] / GIB:>10.1f}{(pred['memory_bytes'] / GIB if pred else 0):>9.1f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
