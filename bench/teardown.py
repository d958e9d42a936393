#!/usr/bin/env python3
"""How long does a local run take to end once training has finished? (issue 23 item 8: <= 0.3 s)

Submits a short local job (examples/quickstart.yaml, 4 steps, 2 ranks by default, no checkpoint
before the final one) with `hpctrain submit --wait` --runs times from a scratch folder, and prints,
from each run's events.jsonl, the seconds from the runtime's `finished` event (rank 0, after the
last step and the final save) to the local executor's `ended` event (every rank has exited, the
supervisor saw it and recorded the outcome), with the median; and the whole submit's wall time.

    python bench/teardown.py --runs 5
    python bench/teardown.py --runs 5 --set parallel.dp=1 --set cluster.gpus_per_node=1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(REPO, "examples", "quickstart.yaml")


def _when(record: dict) -> float:
    value = record.get("time") or record.get("ts") or record.get("timestamp")
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def one_run(workdir: str, sets: list[str]) -> tuple[float, float]:
    argv = [sys.executable, "-m", "hpctrain", "submit", JOB, "--wait", "--set", "train.steps=4",
            "--set", "checkpoint.every_steps=1000", "--set", "train.lr_schedule.warmup_steps=1"]
    for item in sets:
        argv += ["--set", item]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        raise RuntimeError(f"submit failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    runs = sorted(os.path.join(workdir, "runs", d) for d in os.listdir(os.path.join(workdir, "runs")))
    newest = max(runs, key=os.path.getmtime)
    with open(os.path.join(newest, "events.jsonl")) as handle:
        events = [json.loads(line) for line in handle if line.strip()]
    finished = [_when(e) for e in events if e.get("event") == "finished"]
    ended = [_when(e) for e in events if e.get("event") == "ended"]
    if not finished or not ended:
        raise RuntimeError(f"{newest}: no finished/ended events in {[e.get('event') for e in events]}")
    return ended[-1] - finished[-1], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more job overrides")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="teardown-bench-")
    gaps, walls = [], []
    print(f"{JOB}: 4 steps, local executor, `hpctrain submit --wait`, {args.runs} runs {args.set or ''}")
    for i in range(args.runs):
        gap, wall = one_run(workdir, args.set)
        gaps.append(gap)
        walls.append(wall)
        print(f"  run {i + 1}: finished -> ended {gap:.3f} s   submit --wait {wall:.2f} s", flush=True)
    print(f"  median finished -> ended {statistics.median(gaps):.3f} s (min {min(gaps):.3f}, max {max(gaps):.3f});"
          f" submit --wait median {statistics.median(walls):.2f} s  (goal: <= 0.3 s)")


if __name__ == "__main__":
    main()
