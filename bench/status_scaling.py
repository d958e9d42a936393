"""`hpctrain status` (the list of every run in --runs-dir) as the runs directory grows: ms per run directory.

    python bench/status_scaling.py [--runs 9] [--from RUN_DIR]

Makes N = 10 and N = 100 finished local run directories, times `hpctrain status` and `hpctrain status
--json` over each, interleaved (10, 100, 10, 100, ...; the table and --json in turn), and prints the
median wall and CPU time (user + system) of each and the cost of one run directory: the slope
(t(100) - t(10)) / 90. On a loaded machine the CPU slope is the steadier figure.

Each run directory is a copy of RUN_DIR (a finished local run; copied without its checkpoints) or,
without --from, the files a finished 100-step local quickstart run leaves: job.yaml, job.resolved.yaml
and plan.json as `submit --dry-run` writes them, events.jsonl (submitted, started, five checkpoints,
finished, ended), 100 metrics lines, submit/local.json (COMPLETED) and the ranks' logs.
Goal (issue 23 item 8): at most 2 ms per run directory. The machine is shared: run it when it is quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart.yaml"
HPCTRAIN = shutil.which("hpctrain") or f"{sys.executable} -m hpctrain"
SIZES = (10, 100)
GOAL_MS = 2.0


def _events(run_dir: Path, pid: int, start: float) -> list[dict[str, object]]:
    def at(offset_s: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start + offset_s)) + ".000+00:00"

    events: list[dict[str, object]] = [
        {"time": at(0), "event": "submitted", "executor": "local", "job_id": f"local-{pid}", "array": None},
        {"time": at(25), "event": "started", "attempt": 0, "world_size": 2, "launcher": "torchrun",
         "hosts": ["vm"], "device": "cpu"}]
    for n, step in enumerate(range(20, 101, 20)):
        events.append({"time": at(45 + 6 * n), "event": "checkpoint saved", "attempt": 0, "step": step,
                       "path": str(run_dir / "checkpoints" / f"step-{step}"), "duration_s": 0.42,
                       "blocking_s": 0.42, "finalized_after_s": 0.56})
    events.append({"time": at(74), "event": "finished", "attempt": 0, "step": 100, "loss": 0.848,
                   "resumed_from": 0})
    events.append({"time": at(81), "event": "ended", "state": "COMPLETED", "reason": None, "exit_codes": [0, 0],
                   "attempt": 0, "executor": "local"})
    return events


def _metrics(start: float) -> list[dict[str, object]]:
    return [{"step": step, "loss": 10.0 / step, "lr": 0.003 * (1 - step / 110), "grad_norm": 0.39, "tokens": 1024 * step,
             "step_time_s": 0.6013, "tokens_per_s": 1702.8, "tflops_per_gpu": 0.00134, "mfu": None,
             "peak_memory_bytes": 51249152, "time_compute_s": 0.0949, "time_comm_exposed_s": 0.5064,
             "time_bubble_s": 0.0, "attempt": 0, "time": start + 25 + 0.5 * step} for step in range(1, 101)]


def make_template(scratch: Path) -> Path:
    """A finished local run directory of the 100-step quickstart, as a real run leaves it."""
    out = subprocess.run([*HPCTRAIN.split(), "submit", str(QUICKSTART), "--dry-run", "--set", "train.steps=100",
                          "--set", f"runs_dir={scratch / 'dry'}"], check=True, capture_output=True, text=True)
    run_dir = Path(next(line for line in out.stdout.splitlines() if line.startswith("run ")).split(" ", 1)[1])
    start, pid = time.time() - 3600, 20975
    lines = [json.dumps(e, separators=(",", ":")) for e in _events(run_dir, pid, start)]
    (run_dir / "events.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m, separators=(",", ":")) + "\n" for m in _metrics(start)))
    (run_dir / "run_id").write_text("0123456789abcdef\n")
    (run_dir / "submit" / "local.json").write_text(json.dumps(
        {"state": "COMPLETED", "pid": pid, "attempt": 0, "task_id": None, "start_time": start, "hosts": ["vm"],
         "end_time": start + 81, "exit_codes": [0, 0], "reason": None}, indent=2) + "\n")
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "checkpoints" / "owner.json").write_text('{"run_id": "0123456789abcdef"}\n')
    for rank in (0, 1):
        (run_dir / "logs" / f"rank-{rank}.attempt-0.log").write_text("".join(
            f"step {s} loss {10.0 / s:.4f}\n" for s in range(1, 101)))
    return run_dir


def fill(runs_dir: Path, template: Path, count: int) -> None:
    runs_dir.mkdir(parents=True)
    base = time.time() - 86400
    for i in range(count):
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(base + 60 * i))
        shutil.copytree(template, runs_dir / f"quickstart-{stamp}", ignore=shutil.ignore_patterns("step-*"))


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system of the command and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="timed runs of each command (default 9)")
    parser.add_argument("--from", dest="source", metavar="RUN_DIR", help="copy this finished run directory")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        template = Path(opts.source) if opts.source else make_template(scratch)
        for size in SIZES:
            fill(scratch / f"runs-{size}", template, size)
        modes = {"status": [], "status --json": ["--json"]}
        times: dict[tuple[str, int], list[tuple[float, float]]] = {(m, n): [] for m in modes for n in SIZES}
        for size in SIZES:  # warm-up: the page cache and the .pyc files
            for extra in modes.values():
                timed([*HPCTRAIN.split(), "status", "--runs-dir", str(scratch / f"runs-{size}"), *extra])
        for _ in range(opts.runs):
            for mode, extra in modes.items():
                for size in SIZES:
                    argv = [*HPCTRAIN.split(), "status", "--runs-dir", str(scratch / f"runs-{size}"), *extra]
                    times[(mode, size)].append(timed(argv))
    ok = True
    low, high = SIZES
    for mode in modes:
        line = f"hpctrain {mode:<14}"
        for which, label in ((0, "wall"), (1, "cpu")):
            med = {n: statistics.median(t[which] for t in times[(mode, n)]) for n in SIZES}
            per_run_ms = (med[high] - med[low]) / (high - low) * 1000
            if which == 0:
                met = per_run_ms <= GOAL_MS
                ok = ok and met
            line += (f"  {label} {med[low] * 1000:6.0f} ms ({low} runs) {med[high] * 1000:6.0f} ms ({high}) "
                     f"= {per_run_ms:5.2f} ms/run")
        print(f"{line}  [{'ok' if met else 'MISSED'}: goal <= {GOAL_MS:g} ms per run directory, wall]")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
