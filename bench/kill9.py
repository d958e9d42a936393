"""kill -9 on the local executor: a seeded schedule of SIGKILLs, each followed by `hpctrain resume`, and
crash-then-resume-onto-another-layout trials; the run must end with every step once and the numbers of an
uninterrupted run (issue 30: "the 16-trial kill -9 schedule and the 6 layout-change resumes").

    python bench/kill9.py [--seed 7] [--kills 16] [--layouts 6] [--json OUT] [--check]

The job: the tiny preset (4 layers, so that pp2 balances), fp32, the local executor, 32 steps, a checkpoint
every 2 steps, validation every 4 steps (8 batches), the TensorBoard tracker, restart.requeue false (a kill
ends the attempt; the bench resumes it). HPCTRAIN_TEST_STEP_DELAY_S=0.15 slows each step so that the
faults land mid-run. The uninterrupted reference (no delay) runs alongside the trials.

Kill schedule (one rank per run): 16 trials, 4 of each moment, dealt over two runs side by side
(`--kill-runs 2`: 8 trials each, 2 of each moment, each run in its own seeded order; the trials' start-ups then
overlap instead of queueing), each a SIGKILL to the rank or to its local supervisor (seeded; a killed supervisor
takes its rank along, PR_SET_PDEATHSIG):
  save      the first sight of `checkpoints/step-N.partial/` (DCP writing its shards)
  finalize  the first sight of `step-N.partial/.metadata` (DCP is done, the finalize thread has not renamed)
  eval      (step delay + 0.15 s) after the metrics line of the step before an evaluation step
  tracker   the first growth of the TensorBoard event file after the attempt's 1st-3rd step
Each moment is watched by polling every 2 ms; what the run directory held at the kill is recorded
(`hit`), so a missed window shows in the output. Then `hpctrain resume`. After the last trial the run
resumes to the end. Checks, for each killed run: COMPLETED; steps 1..N once in metrics.jsonl; loss, grad_norm and val_loss
equal to the uninterrupted reference's (same job, no faults) bit for bit at every step; the final checkpoint's
tensors (model and optimizer, read with DCP's dcp_to_torch_save) equal the reference's bit for bit;
TensorBoard's reader (which applies each resumed writer's purge_step) shows each step once.

Measured (2-core VM): with one killed run, 230 s and 282 s for the whole --check under load 8-12, 96.9 s quiet,
143-198 s in three fresh-clone CI runs (the suite beside it).

Layout trials (a second run, started alongside): the 1-rank run is killed (SIGKILL of its rank after a
new checkpoint) and resumed on another layout, 6 times in a chain: 1 -> dp2 -> tp2 -> dp2 -> pp2 ->
dp2 -> 1, then to the end. Checks: every resume starts, steps 1..N once, every loss within 1e-5 of the
reference's (the project's criterion for a resume onto another layout, tests/launch/test_launch.py).

`--check` exits 1 when a check fails. tests/launch/test_kill9.py runs it with --check.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "hpctrain"]
MOMENTS = ("save", "finalize", "eval", "tracker")
STEP_DELAY_S = 0.15
EVERY = 2  # checkpoint.every_steps
EVAL_EVERY = 4
POLL_S = 0.002
LAYOUTS: list[tuple[str, dict[str, int]]] = [  # (name, parallel degrees), in chain order
    ("dp2", {"tp": 1, "pp": 1, "gpus": 2}), ("tp2", {"tp": 2, "pp": 1, "gpus": 2}),
    ("dp2", {"tp": 1, "pp": 1, "gpus": 2}), ("pp2", {"tp": 1, "pp": 2, "gpus": 2}),
    ("dp2", {"tp": 1, "pp": 1, "gpus": 2}), ("1", {"tp": 1, "pp": 1, "gpus": 1}),
]
LAYOUT_TOLERANCE = 1e-5


def job(name: str, steps: int, data: Path, val: Path) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"preset": "tiny", "layers": 4, "seq_len": 32},  # 4 layers: pp2 balances
        "train": {"global_batch": 4, "micro_batch": 1, "steps": steps, "precision": "fp32",
                  "activation_checkpointing": "none", "log_every": 1, "seed": 1234, "data": str(data),
                  "eval_data": str(val), "eval_every": EVAL_EVERY, "eval_batches": 8,
                  "lr_schedule": {"warmup_steps": 1}},
        "parallel": {"tp": 1, "pp": 1},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
        "checkpoint": {"every_steps": EVERY, "keep_last": 3},
        "restart": {"requeue": False},
        "monitor": {"tracker": "tensorboard"},
    }


class Bench:
    def __init__(self, work: Path, seed: int) -> None:
        self.work = work
        self.rng = random.Random(seed)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HPCTRAIN_"))}
        self.env.update(PYTHONPATH=str(REPO) + os.pathsep + self.env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
                        PATH=os.path.dirname(sys.executable) + os.pathsep + self.env.get("PATH", ""))
        self.failures: list[str] = []

    def cli(self, args: list[str], delay: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**self.env, **({"HPCTRAIN_TEST_STEP_DELAY_S": str(STEP_DELAY_S)} if delay else {})}
        return subprocess.run([*CLI, *args], cwd=self.work, env=env, capture_output=True, text=True,
                              timeout=timeout_s, stdin=subprocess.DEVNULL)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def submit(self, job_file: Path, *extra: str, delay: bool = True) -> Path:
        result = self.cli(["submit", str(job_file), *extra], delay=delay, timeout_s=300)
        lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("run ")]
        if result.returncode != 0 or not lines:
            raise RuntimeError(f"submit failed: {result.stdout}\n{result.stderr}")
        return Path(lines[-1])

    def resume(self, run_dir: Path, *extra: str) -> None:
        result = self.cli(["resume", str(run_dir), *extra])
        if result.returncode != 0:
            raise RuntimeError(f"resume {' '.join(extra)} failed: {result.stdout}\n{result.stderr}")


def processes(run_dir: Path) -> tuple[list[int], list[int]]:
    """(rank pids, supervisor pids) of a run: processes whose command line names its run directory."""
    ranks, supervisors = [], []
    needle = str(run_dir)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if not any(needle in a for a in argv):
            continue
        if "hpctrain.runtime" in argv:
            ranks.append(int(entry.name))
        elif "hpctrain.launch.local.supervisor" in argv:
            supervisors.append(int(entry.name))
    return ranks, supervisors


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by the kill (the runtime truncates it at resume)
    return out


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = POLL_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def steps_done(run_dir: Path) -> int:
    metrics = lines(run_dir / "metrics.jsonl")
    return max((m["step"] for m in metrics if isinstance(m.get("step"), int)), default=0)


def complete_checkpoints(run_dir: Path) -> set[int]:
    folder = run_dir / "checkpoints"
    out = set()
    for path in folder.glob("step-*"):
        if path.is_dir() and path.name[5:].isdigit():
            out.add(int(path.name[5:]))
    return out


def tensorboard_file(run_dir: Path) -> Optional[Path]:
    files = sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def tensorboard_size(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*"))


def wait_started(run_dir: Path) -> None:
    wait_for(lambda: bool(processes(run_dir)[0]), 120, "the rank to start", poll_s=0.02)


def wait_gone(run_dir: Path) -> None:
    wait_for(lambda: processes(run_dir) == ([], []), 60, "the run's processes to end", poll_s=0.05)


def arm(run_dir: Path, moment: str, rng: random.Random) -> str:
    """Wait for the moment of `moment` in the running attempt; return what the run held when it came."""
    start = steps_done(run_dir)
    if moment == "save":
        target = (start // EVERY + 1) * EVERY
        partial = run_dir / "checkpoints" / f"step-{target}.partial"
        final = run_dir / "checkpoints" / f"step-{target}"
        wait_for(lambda: partial.exists() or final.is_dir(), 120, f"the save of step {target}")
        return f"step-{target}.partial present" if not final.is_dir() else f"missed: step-{target} complete"
    if moment == "finalize":
        target = (start // EVERY + 1) * EVERY
        meta = run_dir / "checkpoints" / f"step-{target}.partial" / ".metadata"
        final = run_dir / "checkpoints" / f"step-{target}"
        wait_for(lambda: meta.exists() or final.is_dir(), 120, f"the finalize of step {target}")
        return f"step-{target}.partial/.metadata, not renamed" if not final.is_dir() else \
            f"missed: step-{target} complete"
    if moment == "eval":
        target = (start // EVAL_EVERY + 1) * EVAL_EVERY
        wait_for(lambda: steps_done(run_dir) >= target - 1, 120, f"step {target - 1}", poll_s=0.005)
        time.sleep(STEP_DELAY_S + 0.15)
        done = steps_done(run_dir)
        return f"before step {target}'s record (validation step)" if done < target else f"missed: step {done} logged"
    # tracker: the TensorBoard file grows when rank 0 logs a step
    after = start + rng.randint(1, 3)
    wait_for(lambda: steps_done(run_dir) >= after - 1, 120, f"step {after - 1}", poll_s=0.005)
    size = tensorboard_size(run_dir)
    wait_for(lambda: tensorboard_size(run_dir) > size, 120, "a TensorBoard write")
    return f"TensorBoard grew after step {steps_done(run_dir)}'s record"


def kill_schedule(bench: Bench, job_file: Path, order: list[str], rng: random.Random, first_trial: int,
                  trials: list[dict[str, Any]]) -> Path:
    """One run through `order`'s kills (its trials appended to `trials`, numbered from `first_trial`)."""
    run_dir = bench.submit(job_file)
    wait_for(lambda: bool(complete_checkpoints(run_dir)), 180, "a first checkpoint", poll_s=0.02)
    for n, moment in enumerate(order):
        i = first_trial + n - 1
        wait_started(run_dir)
        victim = rng.choice(["rank", "supervisor"])
        extra_ms = rng.randint(0, 20) if moment in ("save", "finalize") else 0
        hit = arm(run_dir, moment, rng)
        time.sleep(extra_ms / 1000)
        ranks, supervisors = processes(run_dir)
        pids = ranks if victim == "rank" else supervisors
        step = steps_done(run_dir)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_gone(run_dir)
        trials.append({"trial": i + 1, "moment": moment, "victim": victim, "delay_ms": extra_ms, "hit": hit,
                       "step": step, "killed": len(pids)})
        print(f"{time.strftime('%H:%M:%S')} kill {i + 1:2d}: {moment:8s} {victim:10s} +{extra_ms:2d} ms  step {step:3d}  {hit}", flush=True)
        bench.check(bool(pids), f"kill {i + 1}: no {victim} process to kill")
        bench.resume(run_dir)
    return run_dir


def kill_orders(kills: int, runs: int, rng: random.Random) -> list[list[str]]:
    """The trials' moments, `kills` in all (as many of each moment as can be), dealt round-robin over `runs` runs
    after a seeded shuffle within each moment's share, so each run meets every moment."""
    order = [MOMENTS[i % len(MOMENTS)] for i in range(kills)]
    orders: list[list[str]] = [order[r::runs] for r in range(runs)]
    for one in orders:
        rng.shuffle(one)
    return orders


def layout_chain(bench: Bench, job_file: Path, report: dict[str, Any]) -> Path:
    run_dir = bench.submit(job_file)
    trials = []
    for name, layout in LAYOUTS:
        wait_started(run_dir)
        have = complete_checkpoints(run_dir)
        wait_for(lambda: bool(complete_checkpoints(run_dir) - have), 180, "a new checkpoint", poll_s=0.02)
        step = steps_done(run_dir)
        for pid in processes(run_dir)[0][:1]:  # one rank dies; the supervisor ends the others
            os.kill(pid, signal.SIGKILL)
        wait_gone(run_dir)
        newest = max(complete_checkpoints(run_dir))
        bench.resume(run_dir, "--set", f"cluster.gpus_per_node={layout['gpus']}", "--set",
                     f"parallel.tp={layout['tp']}", "--set", f"parallel.pp={layout['pp']}")
        trials.append({"to": name, "killed_at_step": step, "from_checkpoint": newest})
        print(f"{time.strftime('%H:%M:%S')} layout: killed at step {step:3d}, resumed from step-{newest} on {name}", flush=True)
    report["layouts"] = trials
    return run_dir


def wait_completed(bench: Bench, run_dir: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = bench.cli(["status", str(run_dir), "--json"])
        state = json.loads(result.stdout)["state"] if result.returncode == 0 else "?"
        if state not in ("RUNNING", "PENDING", "?"):
            return str(state)
        time.sleep(0.5)
    return "TIMEOUT"


def final_tensors(run_dir: Path, steps: int) -> dict[str, Any]:
    """Every tensor of the final checkpoint (model and optimizer), read with DCP's own converter."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = run_dir.parent.parent / f"{run_dir.name}-final.pt"  # beside runs/, not in it
    dcp_to_torch_save(str(run_dir / "checkpoints" / f"step-{steps}"), str(out))
    state = torch.load(out, weights_only=False)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value
    walk("", state)
    return flat


def tensorboard_steps(run_dir: Path) -> list[int]:
    """The loss steps TensorBoard shows: its reader over the folder applies each resumed writer's purge_step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars("loss")] if "loss" in acc.Tags().get("scalars", []) else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kills", type=int, default=16)
    parser.add_argument("--layouts", type=int, default=len(LAYOUTS), help="layout-change trials (at most 6)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--kill-runs", type=int, default=2,
                        help="runs the kills are spread over, side by side (each its own seeded schedule)")
    parser.add_argument("--json", type=Path, help="write the trials and checks here")
    parser.add_argument("--work", type=Path, help="folder for the runs (default: a temporary one)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    args = parser.parse_args()
    del LAYOUTS[args.layouts:]
    started = time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="hpct-kill9-"))
    work.mkdir(parents=True, exist_ok=True)
    bench = Bench(work, args.seed)
    data, val = work / "d.bin", work / "d.val.bin"
    for source, out in ((REPO / "README.md", data), (REPO / "docs" / "architecture.md", val)):
        prepared = bench.cli(["data", "prepare", str(source), "-o", str(out)])
        if prepared.returncode != 0:
            raise RuntimeError(prepared.stderr)
    files = {}
    killed_names = ["killed"] if args.kill_runs <= 1 else [f"killed{r + 1}" for r in range(args.kill_runs)]
    for name in ("reference", *killed_names, "layouts"):
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job(name, args.steps, data, val), sort_keys=False))
        files[name] = path
    report: dict[str, Any] = {"seed": args.seed, "steps": args.steps}

    reference = bench.submit(files["reference"], delay=False)  # alongside the trials, waited for at the end
    results: dict[str, Path] = {}
    errors: list[BaseException] = []

    def chain() -> None:
        try:
            results["layouts"] = layout_chain(bench, files["layouts"], report)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    orders = kill_orders(args.kills, len(killed_names), bench.rng) if args.kills else []
    trial_lists: list[list[dict[str, Any]]] = [[] for _ in orders]

    def kills(index: int) -> None:
        first = 1 + sum(len(o) for o in orders[:index])
        try:
            results[killed_names[index]] = kill_schedule(bench, files[killed_names[index]], orders[index],
                                                         random.Random(args.seed * 1000 + index), first,
                                                         trial_lists[index])
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=chain)] if args.layouts else []
    threads += [threading.Thread(target=kills, args=(index,)) for index in range(len(orders))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    report["kills"] = [t for trials in trial_lists for t in trials]

    bench.check(wait_completed(bench, reference, 300) == "COMPLETED", "the reference did not complete")
    ref = {m["step"]: m for m in lines(reference / "metrics.jsonl") if "loss" in m}
    bench.check(sorted(ref) == list(range(1, args.steps + 1)), f"reference steps {sorted(ref)}")
    for name, run_dir in results.items():
        state = wait_completed(bench, run_dir, 300)
        bench.check(state == "COMPLETED", f"{name}: ended {state}")
        metrics = [m for m in lines(run_dir / "metrics.jsonl") if "loss" in m]
        steps = [m["step"] for m in metrics]
        bench.check(steps == list(range(1, args.steps + 1)), f"{name}: steps {steps} (each step once)")
        for m in metrics:
            r = ref.get(m["step"], {})
            if name.startswith("killed"):
                same = (m["loss"], m.get("grad_norm"), m.get("val_loss")) == (
                    r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                bench.check(same, f"{name}: step {m['step']} differs from the reference: {m} vs {r}")
            else:
                bench.check(abs(m["loss"] - r.get("loss", float("inf"))) <= LAYOUT_TOLERANCE,
                            f"layouts: step {m['step']} loss {m['loss']} vs reference {r.get('loss')}")
    killed_runs = [name for name in killed_names if name in results]
    if killed_runs and not bench.failures:
        theirs = final_tensors(reference, args.steps)
        report["final_tensors_compared"] = 0
        for name in killed_runs:
            mine = final_tensors(results[name], args.steps)
            bench.check(sorted(mine) == sorted(theirs), f"{name}: the final checkpoint holds other tensors")
            differ = [k for k in mine if k in theirs and not bool((mine[k] == theirs[k]).all())]
            bench.check(not differ, f"{name}: final tensors differ from the reference's: {differ[:5]}")
            report["final_tensors_compared"] += len(mine)
            tb = tensorboard_steps(results[name])
            bench.check(tb == list(range(1, args.steps + 1)), f"{name}: TensorBoard steps {tb} (each once)")
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["failures"] = bench.failures
    hits = sum(1 for t in report.get("kills", []) if not t["hit"].startswith("missed"))
    print(f"{len(report.get('kills', []))} kills ({hits} in their window), {len(report.get('layouts', []))} layout "
          f"changes, {len(bench.failures)} failed checks, {report['wall_s']} s", flush=True)
    for failure in bench.failures:
        print(f"FAILED: {failure}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if args.check and bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
