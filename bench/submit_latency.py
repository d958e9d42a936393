"""Median time from `hpctrain submit` (and a 64-point `hpctrain sweep`) to the job being visible in squeue.

    python bench/submit_latency.py [--runs 7] [--sweep-runs 3] [--points 64] [--check] [--ray [--ray-runs 3]]

With --ray it also reports submit -> running for Slurm and for Ray side by side (bench/ray_latency.py):
a local Ray head (tests/ray_cluster.py, 2 CPUs, loopback) is started and stopped for it.

Needs a Slurm: uses the one SLURM_CONF points at when `squeue` answers, else starts the project's
local test cluster (tests/slurm_cluster.py; root and scripts/install-test-deps) in a temporary folder
and stops it at the end. Jobs are submitted held (`--hold`, via slurm.extra) so nothing runs, and
cancelled afterwards. Goals (issue 6): submit < 1 s, 64-point sweep < 2 s. `--check` exits 1 if
a goal is missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
SUBMIT_GOAL_S = 1.0
SWEEP_GOAL_S = 2.0
# The CLI as a user runs it.
CLI = [sys.executable, "-c",
       "import sys; from hpctrain.cli import main; sys.exit(main())"]

JOB = """\
name: submit-latency
model:
  preset: tiny
train:
  global_batch: 8
  micro_batch: 1
  steps: 10
  precision: fp32
  activation_checkpointing: none
parallel: {tp: 1, pp: 1, dp: 1, zero: 0}
cluster:
  executor: slurm
  nodes: 1
  gpus_per_node: 1
  gpu: a100-80gb
slurm:
  partition: low
  exclusive: false
  extra:
    hold: true
"""


def _slurm_answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["squeue", "-h"], env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _visible(env: dict[str, str], job_id: str, tasks: int) -> bool:
    out = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%i"], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    return len(out.split()) >= tasks


def time_to_visible(argv: list[str], env: dict[str, str], cwd: Path, tasks: int,
                    timeout_s: float = 60.0) -> tuple[float, float, str]:
    """(seconds until the job shows in squeue, seconds the CLI took, job id)."""
    start = time.perf_counter()
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    cli_s = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[3:])} failed ({result.returncode}):\n{result.stderr}")
    job_id = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("job "))
    while not _visible(env, job_id, tasks):
        if time.perf_counter() - start > timeout_s:
            raise SystemExit(f"job {job_id} not visible in squeue after {timeout_s:g} s")
        time.sleep(0.01)
    return time.perf_counter() - start, cli_s, job_id


def run(env: dict[str, str], work: Path, runs: int, sweep_runs: int, points: int) -> tuple[float, float]:
    job_path = work / "job.yaml"
    job_path.write_text(JOB)
    env = {**env, "PYTHONPATH": str(REPO)}
    submit, sweep, ids = [], [], []
    for _ in range(runs):
        total_s, cli_s, job_id = time_to_visible([*CLI, "submit", str(job_path)], env, work, 1)
        submit.append((total_s, cli_s))
        ids.append(job_id)
    grid = "train.seed=" + ",".join(str(k) for k in range(points))
    for _ in range(sweep_runs):
        total_s, cli_s, job_id = time_to_visible([*CLI, "sweep", str(job_path), "--grid", grid], env, work, points)
        sweep.append((total_s, cli_s))
        ids.append(job_id)
    subprocess.run(["scancel", *ids], env=env, capture_output=True, timeout=30)
    submit_s = statistics.median(t for t, _ in submit)
    sweep_s = statistics.median(t for t, _ in sweep)
    print(f"{'what':34} {'median to squeue':>17} {'median CLI':>11} {'goal':>6}")
    print(f"{'submit (1 job)':34} {submit_s:16.3f}s {statistics.median(c for _, c in submit):10.3f}s "
          f"{SUBMIT_GOAL_S:5.1f}s  {'ok' if submit_s < SUBMIT_GOAL_S else 'MISSED'}  ({runs} runs)")
    print(f"{f'sweep ({points} points, one array)':34} {sweep_s:16.3f}s {statistics.median(c for _, c in sweep):10.3f}s "
          f"{SWEEP_GOAL_S:5.1f}s  {'ok' if sweep_s < SWEEP_GOAL_S else 'MISSED'}  ({sweep_runs} runs)")
    return submit_s, sweep_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--sweep-runs", type=int, default=3)
    parser.add_argument("--points", type=int, default=64)
    parser.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    parser.add_argument("--ray", action="store_true", help="also: submit -> running on Slurm and on Ray")
    parser.add_argument("--ray-runs", type=int, default=3)
    args = parser.parse_args()
    cluster: Optional[object] = None
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="hpct-bench-") as tmp:
        if not (env.get("SLURM_CONF") and _slurm_answers(env)):
            sys.path.insert(0, str(REPO / "tests"))
            from slurm_cluster import SlurmCluster

            cluster = SlurmCluster(Path(tmp) / "slurm")
            started = time.perf_counter()
            cluster.start(timeout_s=90)
            print(f"started the local test cluster in {time.perf_counter() - started:.1f} s", file=sys.stderr)
            env = cluster.client_env()
        try:
            work = Path(tmp) / "work"
            work.mkdir()
            submit_s, sweep_s = run(env, work, args.runs, args.sweep_runs, args.points)
            if args.ray:
                sys.path.insert(0, str(REPO / "bench"))
                from ray_latency import compare_running

                compare_running(env, Path(tmp), args.ray_runs)
        finally:
            if cluster is not None:
                cluster.stop()  # type: ignore[attr-defined]
    missed = submit_s >= SUBMIT_GOAL_S or sweep_s >= SWEEP_GOAL_S
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
