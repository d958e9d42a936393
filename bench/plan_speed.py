"""Speed of `hpctrain plan` over a spread of models, GPU counts and batch sizes, full search, CLI wall time.

    python bench/plan_speed.py [--runs 5] [--only NAME ...]

For each case: the median wall time of the whole command (interpreter start, imports, job loading, the
search over every layout, the report) as `hpctrain plan` runs it (a large search split over the CPUs this
process may use, plan/split_search.py) and with --workers 1, the median of the search alone in one process
(plan_job's elapsed_s, in process), the candidates evaluated, and the wall time over `python -c pass` (the machine may be shared: the ratio and
the search-only time say what the planner itself costs). Then the slowest case. Goals (issue 26 item 1):
a dense case under 0.5 s, the MoE cases (every dimension free, parallel.ep auto; at 32K tokens cp too) under
1.0 s, whole process.
Exit 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DENSE_GOAL_S = 0.5
MOE_GOAL_S = 1.0
FREE = "{tp: auto, pp: auto, dp: auto, schedule: auto, virtual_stages: auto, zero: auto, sequence_parallel: true"
# (name, kind, job): kind "dense" or "moe" picks the goal.
CASES: list[tuple[str, str, str]] = [
    # Brown et al. 2020's GPT-3 175B at its global batch 1536 on 48 DGX A100 nodes (examples/gpt3-175b.yaml's model).
    ("gpt3-175b-384xa100", "dense", f"""\
name: gpt3-175b-speed
model: {{preset: gpt3-175b}}
train: {{global_batch: 1536, micro_batch: auto, activation_checkpointing: auto}}
parallel: {FREE}}}
cluster: {{nodes: 48, gpus_per_node: 8, gpu: a100-80gb, node: dgx-a100, fabric: ib-hdr200}}
"""),
    # Llama 3 70B on 8 DGX H100 nodes, 4M tokens per step (batch 512 x 8192).
    ("llama3-70b-64xh100", "dense", f"""\
name: llama3-70b-speed
model: {{preset: llama3-70b}}
train: {{global_batch: 512, micro_batch: auto, activation_checkpointing: auto}}
parallel: {FREE}}}
cluster: {{nodes: 8, gpus_per_node: 8, gpu: h100-80gb, node: dgx-h100, fabric: ib-ndr400}}
"""),
    # Megatron-LM's 1T configuration (Narayanan et al. 2021, table 1) on 512 DGX A100 nodes.
    ("gpt-1t-4096xa100", "dense", f"""\
name: gpt-1t-speed
model: {{layers: 128, hidden: 25600, heads: 160, ffn_hidden: 102400, vocab: 51200, seq_len: 2048,
        activation: gelu, tie_embeddings: true}}
train: {{global_batch: 3072, micro_batch: auto, activation_checkpointing: auto}}
parallel: {FREE}}}
cluster: {{nodes: 512, gpus_per_node: 8, gpu: a100-80gb, node: dgx-a100, fabric: ib-ndr400}}
"""),
    # Qwen3-235B-A22B (128 experts, top-8) at 4096 tokens on 256 DGX H100 nodes, every dimension free, ep too.
    ("qwen3-235b-2048xh100", "moe", f"""\
name: qwen3-235b-speed
model: {{preset: qwen3-235b-a22b, seq_len: 4096}}
train: {{global_batch: 2048, micro_batch: auto, activation_checkpointing: auto}}
parallel: {FREE}, ep: auto}}
cluster: {{nodes: 256, gpus_per_node: 8, gpu: h100-80gb, node: dgx-h100, fabric: ib-ndr400}}
"""),
    # The same model and cluster at 32K tokens: context parallelism enters the search (plan/context.py:
    # cp 1-64 from 16K tokens), the largest space of the spread (~41,000 candidates, 908 tp x pp x cp x ep families).
    ("qwen3-235b-32k-2048xh100", "moe", f"""\
name: qwen3-235b-32k-speed
model: {{preset: qwen3-235b-a22b, seq_len: 32768}}
train: {{global_batch: 1024, micro_batch: auto, activation_checkpointing: auto}}
parallel: {FREE}, ep: auto}}
cluster: {{nodes: 256, gpus_per_node: 8, gpu: h100-80gb, node: dgx-h100, fabric: ib-ndr400}}
"""),
]


def _median_wall_s(command: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", nargs="*", help="case names (default: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from hpctrain.config import load_job
    from hpctrain.plan import plan_job

    from hpctrain.plan.split_search import MIN_SPLIT_CANDIDATES, search_workers

    cases = [c for c in CASES if not args.only or c[0] in args.only]
    baseline = _median_wall_s([sys.executable, "-c", "pass"], args.runs)
    workers = search_workers()
    print(f"python -c pass: median {baseline:.3f} s over {args.runs} runs; `hpctrain plan` may use {workers} "
          f"process(es) (the CPUs this one may run on) for searches of more than {MIN_SPLIT_CANDIDATES:,} candidates; "
          "'1 process' is --workers 1")
    rows = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, kind, text in cases:
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(text)
            wall = _median_wall_s([sys.executable, "-m", "hpctrain", "plan", str(path)], args.runs)
            one_wall = _median_wall_s([sys.executable, "-m", "hpctrain", "plan", "--workers", "1", str(path)],
                                      args.runs)
            job = load_job(str(path))
            searches = []
            for _ in range(args.runs):
                result = plan_job(job)
                searches.append(result.elapsed_s)
            search_s = statistics.median(searches)
            goal = MOE_GOAL_S if kind == "moe" else DENSE_GOAL_S
            met = wall < goal
            ok &= met
            rows.append((wall, name))
            print(f"{name:<22} {kind:<5} wall {wall:.3f} s ({wall / baseline:.1f}x python -c pass; 1 process "
                  f"{one_wall:.3f} s), search in 1 process {search_s * 1000:.0f} ms, {result.evaluated} candidates ({result.evaluated / search_s:,.0f}/s), "
                  f"{len(result.layouts)} fit; goal < {goal} s {'met' if met else 'MISSED'}; "
                  f"best: {result.best.label()}")
    wall, name = max(rows)
    print(f"slowest: {name} {wall:.3f} s; goals {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
