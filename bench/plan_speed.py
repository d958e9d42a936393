"""Speed of `hpctrain plan`: a 1T-parameter model on 4096 GPUs, full search, CLI wall time.

    python bench/plan_speed.py [--runs 10]

Prints the median wall time of the whole command (interpreter start, imports, job loading, the
search over every layout, the report) beside `python -c pass`, and the candidates evaluated per
second of the search itself. Goal: median under 0.5 s. Exit 1 when the goal is missed.
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
GOAL_S = 0.5
# Megatron-LM's 1T configuration (Narayanan et al. 2021, table 1) on 512 DGX A100 nodes.
JOB = """\
name: gpt-1t-speed
model: {layers: 128, hidden: 25600, heads: 160, ffn_hidden: 102400, vocab: 51200, seq_len: 2048,
        activation: gelu, tie_embeddings: true}
train: {global_batch: 3072, micro_batch: auto, activation_checkpointing: auto}
parallel: {tp: auto, pp: auto, dp: auto, schedule: auto, virtual_stages: auto, zero: auto, sequence_parallel: true}
cluster: {nodes: 512, gpus_per_node: 8, gpu: a100-80gb, node: dgx-a100, fabric: ib-ndr400}
"""
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
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt-1t.yaml"
        path.write_text(JOB)
        command = [sys.executable, "-m", "hpctrain", "plan", str(path)]
        baseline = _median_wall_s([sys.executable, "-c", "pass"], args.runs)
        wall = _median_wall_s(command, args.runs)

        from hpctrain.config import load_job
        from hpctrain.plan import plan_job

        job = load_job(str(path))
        searches = []
        for _ in range(args.runs):
            result = plan_job(job)
            searches.append(result.elapsed_s)
    search_s = statistics.median(searches)
    print(f"hpctrain plan (1T parameters, 4096 x a100-80gb): median {wall:.3f} s over {args.runs} runs "
          f"(python -c pass: {baseline:.3f} s)")
    print(f"search: {result.evaluated} candidates, {len(result.layouts)} fit, median {search_s * 1000:.0f} ms "
          f"= {result.evaluated / search_s:,.0f} candidates/s; best: {result.best.label()}")
    ok = wall < GOAL_S
    print(f"goal: under {GOAL_S} s -> {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
