"""Submit -> running on Slurm and on Ray, side by side (called by bench/submit_latency.py --ray).

"Running" is what each scheduler reports (squeue state R; Ray's job status RUNNING, i.e. the driver
started) and, for both, the runtime's first `started` event in events.jsonl (every rank initialised).
The job is the tiny preset on 1 CPU rank for 2 steps; Slurm gets the local test cluster the caller
set up, Ray a fresh local head (tests/ray_cluster.py) that is stopped afterwards.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "hpctrain"]


def _job(executor: str) -> str:
    slurm = "slurm: {partition: low, exclusive: false}\n" if executor == "slurm" else ""
    return (f"name: running-{executor}\nmodel: {{preset: tiny}}\n"
            "train: {global_batch: 2, micro_batch: 1, steps: 2, precision: fp32, activation_checkpointing: none}\n"
            "parallel: {tp: 1, pp: 1}\n"
            f"cluster: {{executor: {executor}, nodes: 1, gpus_per_node: 1, gpu: cpu}}\n{slurm}")


def _started(run_dir: Path) -> bool:
    try:
        return any(json.loads(line).get("event") == "started" for line in (run_dir / "events.jsonl").read_text().splitlines()
                   if line.strip())
    except (OSError, ValueError):
        return False


def _one(executor: str, env: dict[str, str], work: Path, running: Callable[[str], bool]) -> tuple[float, float]:
    """(seconds to the scheduler's running, seconds to the runtime's started event) for one submission."""
    job = work / f"{executor}.yaml"
    job.write_text(_job(executor))
    start = time.perf_counter()
    result = subprocess.run([*CLI, "submit", str(job)], env=env, cwd=work, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise SystemExit(f"{executor} submit failed ({result.returncode}): {result.stderr}")
    job_id = next(line.split()[1] for line in result.stdout.splitlines() if line.startswith("job "))
    run_dir = Path(next(line[4:] for line in result.stdout.splitlines() if line.startswith("run ")))
    to_running = None
    while True:
        now = time.perf_counter() - start
        if to_running is None and running(job_id):
            to_running = now
        if _started(run_dir):
            return (to_running if to_running is not None else now), now
        if now > 300:
            raise SystemExit(f"{executor} job {job_id} did not start in 300 s")
        time.sleep(0.05)


def compare_running(slurm_env: dict[str, str], tmp: Path, runs: int) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from ray_cluster import RayCluster
    from ray.job_submission import JobSubmissionClient

    work = tmp / "running"
    work.mkdir()
    env = {**slurm_env, "PYTHONPATH": str(REPO)}

    def squeue_running(job_id: str) -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True,
                             timeout=30).stdout
        return "RUNNING" in out or "COMPLETING" in out

    slurm = [_one("slurm", env, work, squeue_running) for _ in range(runs)]
    started = time.perf_counter()
    cluster = RayCluster(tmp / "ray-start.log", cpus=2, pythonpath=str(REPO)).start()
    ray_start_s = time.perf_counter() - started
    try:
        client = JobSubmissionClient(cluster.address)
        ray_env = {**env, "RAY_ADDRESS": cluster.address}
        ray_runs = [_one("ray", ray_env, work, lambda j: str(client.get_job_status(j)) in ("JobStatus.RUNNING", "RUNNING",
                                                                                          "JobStatus.SUCCEEDED"))
                    for _ in range(runs)]
    finally:
        cluster.stop()
    print(f"\n{'submit -> running':34} {'scheduler running':>17} {'ranks started':>14}")
    for name, rows in (("slurm (local test cluster)", slurm), ("ray (local head, 2 CPUs)", ray_runs)):
        print(f"{name:34} {statistics.median(r for r, _ in rows):16.3f}s {statistics.median(s for _, s in rows):13.3f}s"
              f"  ({runs} runs)")
    print(f"(the Ray head took {ray_start_s:.1f} s to answer its Jobs API; not included above)")
