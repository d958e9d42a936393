"""Chaos on a real Slurm: a 4-rank job survives a seeded schedule of faults with its loss curve intact.

    python bench/chaos.py [--seed 7] [--steps 120] [--delay 0.25] [--json OUT] [--check]

The job: the tiny model, tp2 x dp2 over 2 nodes, fp32, a checkpoint every 5 steps, submitted with
`hpctrain submit`; HPCTRAIN_TEST_STEP_DELAY_S slows each step so that faults land mid-run. Faults,
in a seeded random order, each a seeded number of steps into an attempt:

  requeue     `scontrol requeue JOB` from outside (Slurm stops the job; the ranks' SIGTERM saves)
  preempt     a job in the `high` partition that needs both whole nodes (PreemptMode=REQUEUE: the ranks
              get the signal, save, exit 0; the batch script requeues)
  kill-rank   SIGKILL to one rank's process (chosen by the seed): srun ends the others, the batch script
              requeues, the next attempt resumes from the last complete checkpoint
  time-limit  `scontrol update JobId=JOB TimeLimit=M` leaving less than restart.signal_seconds: Slurm
              sends the signal at its next limit check (~30 s tick); the ranks save, the script requeues;
              the original limit is put back once the job is pending again

The reference is the same job, uninterrupted, run alongside with the local executor (no delay).
Checks: the job COMPLETED on its own; each step 1..N once in metrics.jsonl; loss and grad_norm equal
to the reference's bit for bit at every step; `hpctrain status` counts one restart per fault.
Prints one line per fault (step, seconds until running again, what the run logged) and a summary.

Needs a Slurm with partitions `low` (default, preemptible) and `high`, whose nodes run on this
machine (kill-rank finds the rank's process in /proc): SLURM_CONF if squeue answers, else the
local test cluster (tests/slurm_cluster.py; root). `--check` exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "hpctrain"]
FAULTS = ("requeue", "preempt", "kill-rank", "time-limit")
ORIGINAL_LIMIT = "00:15:00"
SIGNAL_SECONDS = 120
LIMIT_LEAD_S = 50  # time-limit fault: 50-110 s left, below SIGNAL_SECONDS -> signal at the next tick
JOB = """\
name: chaos
model: {{preset: tiny, layers: 2, seq_len: 32}}
train: {{global_batch: 8, micro_batch: 2, steps: {steps}, precision: fp32, activation_checkpointing: none,
        log_every: 1, seed: 1234, lr_schedule: {{warmup_steps: 2}}}}
parallel: {{tp: 2, pp: 1, dp: 2, zero: 0}}
cluster: {{executor: {executor}, nodes: 2, gpus_per_node: 2, gpu: a100-80gb}}
runtime: {{allow_cpu: true}}  # planned for A100s; the test cluster's GPUs are device files, the ranks use the CPU
slurm: {{partition: low, time: "{limit}", exclusive: false}}
restart: {{max_requeues: 10, signal: USR2, signal_seconds: {signal_seconds}}}
checkpoint: {{every_steps: 5, keep_last: 2}}
runs_dir: {runs_dir}
"""


def slurm(env: dict[str, str], *argv: str, check: bool = True) -> str:
    out = subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
    return out.stdout


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    from hpctrain.launch.slurm.parsers import parse_scontrol_record

    line = slurm(env, "scontrol", "-o", "show", "job", job_id, check=False).strip()
    return parse_scontrol_record(line.splitlines()[0]) if line else {}


def run_seconds(text: str) -> int:
    """scontrol's RunTime ([D-]HH:MM:SS) in seconds."""
    days, _, clock = text.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def poll(check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def rank_pid(run_dir: Path, job_id: str, rank: int) -> Optional[int]:
    """The pid of rank `rank` of job `job_id` on this machine: its command names the run directory (job
    ids repeat across test clusters), its environment the job and the rank."""
    want = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURM_PROCID={rank}".encode()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if f"--run-dir={run_dir}".encode() not in argv or not os.path.basename(argv[0]).startswith(b"python"):
                continue  # srun and the batch script carry the same variables
            if want <= set(Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")):
                return int(entry)
        except OSError:
            continue
    return None


class Chaos:
    """Submits the job, injects the faults, and collects what happened."""

    def __init__(self, env: dict[str, str], work: Path, seed: int, steps: int, delay_s: float) -> None:
        self.env, self.work, self.seed, self.steps, self.delay_s = env, work, seed, steps, delay_s
        self.rng = random.Random(seed)
        self.schedule = [(kind, self.rng.randint(2, 5)) for kind in self.rng.sample(FAULTS, len(FAULTS))]
        self.kill_rank = self.rng.randrange(4)
        self.job_id = ""
        self.run_dir = Path()
        self.log: list[dict[str, Any]] = []

    # -- submission ---------------------------------------------------------------------------------
    def _job_file(self, name: str, executor: str) -> Path:
        path = self.work / f"{name}.yaml"
        path.write_text(JOB.format(steps=self.steps, executor=executor, limit=ORIGINAL_LIMIT,
                                   signal_seconds=SIGNAL_SECONDS, runs_dir=self.work / f"runs-{name}"))
        return path

    def submit(self) -> None:
        env = {**self.env, "HPCTRAIN_TEST_STEP_DELAY_S": str(self.delay_s)}
        out = subprocess.run([*CLI, "submit", str(self._job_file("chaos", "slurm"))], env=env,
                             capture_output=True, text=True, timeout=60, cwd=self.work)
        if out.returncode != 0:
            raise RuntimeError(f"hpctrain submit failed:\n{out.stderr}")
        self.job_id = re.search(r"^job (\S+)$", out.stdout, re.M).group(1)  # type: ignore[union-attr]
        self.run_dir = Path(re.search(r"^run (.+)$", out.stdout, re.M).group(1))  # type: ignore[union-attr]

    def reference(self, result: dict[str, Any]) -> None:
        """The uninterrupted run (local executor, no delay); fills result['run_dir'], ['wall_s']."""
        env = {k: v for k, v in self.env.items() if not k.startswith("HPCTRAIN_TEST_")}
        started = time.perf_counter()
        out = subprocess.run([*CLI, "submit", str(self._job_file("reference", "local")), "--wait", "--timeout", "600"],
                             env=env, capture_output=True, text=True, timeout=660, cwd=self.work)
        result["wall_s"] = time.perf_counter() - started
        result["returncode"] = out.returncode
        match = re.search(r"^run (.+)$", out.stdout, re.M)
        result["run_dir"] = match.group(1) if match else None
        result["stderr"] = out.stderr[-2000:]

    # -- observation ---------------------------------------------------------------------------------
    def info(self) -> dict[str, str]:
        return job_info(self.env, self.job_id)

    def restarts(self) -> int:
        return int(self.info().get("Restarts", "0") or 0)

    def steps_in_attempt(self, attempt: int) -> list[int]:
        return [m["step"] for m in read_jsonl(self.run_dir / "metrics.jsonl") if m.get("attempt") == attempt]

    def _ended(self) -> Optional[str]:
        info = self.info()
        state = info.get("JobState", "")
        return state if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None

    def wait_steps(self, attempt: int, count: int) -> int:
        """Wait until attempt `attempt` has logged `count` steps; return the last one."""
        def ready() -> Optional[int]:
            steps = self.steps_in_attempt(attempt)
            if len(steps) >= count:
                return steps[-1]
            ended = self._ended()
            if ended:
                raise RuntimeError(f"the job ended {ended} during attempt {attempt} before the next fault")
            return None
        return int(poll(ready, 240, f"{count} steps of attempt {attempt}"))

    # -- faults --------------------------------------------------------------------------------------
    def inject(self, kind: str) -> str:
        if kind == "requeue":
            slurm(self.env, "scontrol", "requeue", self.job_id)
            return f"scontrol requeue {self.job_id}"
        if kind == "preempt":
            out = slurm(self.env, "sbatch", "--parsable", "--partition=high", "--nodes=2", "--exclusive",
                        f"--output={self.work}/preemptor-%j.out", "--wrap", "sleep 2")
            return f"high-partition job {out.strip()} on both nodes"
        if kind == "kill-rank":
            pid = rank_pid(self.run_dir, self.job_id, self.kill_rank)
            if pid is None:
                raise RuntimeError(f"rank {self.kill_rank} of job {self.job_id} not found in /proc")
            os.kill(pid, signal.SIGKILL)
            return f"SIGKILL to rank {self.kill_rank} (pid {pid})"
        info = self.info()
        elapsed_s = run_seconds(info["RunTime"])
        minutes = math.ceil((elapsed_s + LIMIT_LEAD_S) / 60)
        slurm(self.env, "scontrol", "update", f"JobId={self.job_id}", f"TimeLimit={minutes}")
        return f"TimeLimit={minutes} min after {elapsed_s} s: {60 * minutes - elapsed_s} s left"

    def run(self) -> dict[str, Any]:
        reference: dict[str, Any] = {}
        ref_thread = threading.Thread(target=self.reference, args=(reference,))
        started = time.perf_counter()
        self.submit()
        ref_thread.start()
        for kind, after_steps in self.schedule:
            attempt = self.restarts()
            step = self.wait_steps(attempt, after_steps)
            injected = time.perf_counter()
            how = self.inject(kind)
            poll(lambda: self.restarts() > attempt, 150, f"job {self.job_id} to be requeued after {kind}")
            requeued_s = time.perf_counter() - injected
            if kind == "time-limit":
                slurm(self.env, "scontrol", "update", f"JobId={self.job_id}", f"TimeLimit={ORIGINAL_LIMIT}")
            poll(lambda: self.info().get("JobState") == "RUNNING" or self._ended(), 120, "the job to run again")
            running_s = time.perf_counter() - injected
            self.log.append({"fault": kind, "attempt": attempt, "at_step": step, "how": how,
                             "requeued_after_s": round(requeued_s, 1), "running_after_s": round(running_s, 1)})
            print(f"  {kind:10} attempt {attempt} step {step:>4}: {how}; requeued after {requeued_s:5.1f} s, "
                  f"running after {running_s:5.1f} s", flush=True)
        final = poll(self._ended, 600, "the job to end", interval_s=0.5)
        chaos_s = time.perf_counter() - started
        ref_thread.join()
        return self.verdict(final, chaos_s, reference)

    # -- checks --------------------------------------------------------------------------------------
    def verdict(self, final: str, chaos_s: float, reference: dict[str, Any]) -> dict[str, Any]:
        metrics = read_jsonl(self.run_dir / "metrics.jsonl")
        ref = read_jsonl(Path(reference["run_dir"]) / "metrics.jsonl") if reference.get("run_dir") else []
        steps = [m["step"] for m in metrics]
        mismatches = [s for s, (a, b) in enumerate(zip(metrics, ref), 1)
                      if (a["step"], a["loss"], a["grad_norm"]) != (b["step"], b["loss"], b["grad_norm"])]
        status = json.loads(subprocess.run([*CLI, "status", str(self.run_dir), "--json"], env=self.env,
                                           capture_output=True, text=True, timeout=60).stdout or "{}")
        events = read_jsonl(self.run_dir / "events.jsonl")
        resumed = [e["step"] for e in events if e.get("event") == "resumed"]
        why = [(e.get("attempt"), e["event"], e.get("reason") or e.get("signal")) for e in events
               if e.get("event") in ("signal", "requeued", "not_requeued", "requeue requested")]
        checks = {
            "completed": final == "COMPLETED",
            "steps_once": steps == list(range(1, self.steps + 1)),
            "curve_bit_identical": bool(ref) and len(ref) == len(metrics) and not mismatches,
            "status_restarts": status.get("restarts") == len(self.schedule),
            "reference_ok": reference.get("returncode") == 0,
        }
        return {"seed": self.seed, "steps": self.steps, "delay_s": self.delay_s, "job_id": self.job_id,
                "run_dir": str(self.run_dir), "final_state": final, "faults": self.log,
                "status_restarts": status.get("restarts"), "status_state": status.get("state"),
                "resumed_from": resumed, "events": why, "mismatched_steps": mismatches[:20],
                "chaos_wall_s": round(chaos_s, 1), "reference_wall_s": round(reference.get("wall_s", 0.0), 1),
                "reference_stderr": reference.get("stderr") if reference.get("returncode") else None,
                "checks": checks, "ok": all(checks.values())}


def _slurm_answers(env: dict[str, str]) -> bool:
    try:
        return subprocess.run(["squeue", "-h"], env=env, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--steps", type=int, default=120)
    # ~0.5 s a step on 2 cores: the time-limit fault waits up to 30 s for Slurm's tick, and the job must
    # not run out of steps meanwhile.
    parser.add_argument("--delay", type=float, default=0.25,
                        help="seconds of sleep per step (HPCTRAIN_TEST_STEP_DELAY_S)")
    parser.add_argument("--json", metavar="OUT", help="also write the result as JSON here")
    parser.add_argument("--work", metavar="DIR", help="keep the run directories here (default: a temporary folder)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a check fails")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cluster: Any = None
    with tempfile.TemporaryDirectory(prefix="hpct-chaos-") as tmp:
        work = Path(args.work or tmp).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if not (env.get("SLURM_CONF") and _slurm_answers(env)):
            sys.path.insert(0, str(REPO / "tests"))
            from slurm_cluster import SlurmCluster

            cluster = SlurmCluster(Path(tmp) / "slurm")
            cluster.start(timeout_s=90)
            env = {**env, **cluster.env}
        try:
            chaos = Chaos(env, work, args.seed, args.steps, args.delay)
            print(f"chaos: seed {args.seed}, {args.steps} steps, faults in order "
                  f"{', '.join(f'{k} (+{n} steps)' for k, n in chaos.schedule)}; kill-rank hits rank "
                  f"{chaos.kill_rank}", flush=True)
            result = chaos.run()
        finally:
            if cluster is not None:
                cluster.stop()
    for name, ok in result["checks"].items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    print(f"chaos: {result['final_state']} after {result['chaos_wall_s']} s with {len(result['faults'])} faults "
          f"(status restarts {result['status_restarts']}); resumed from steps {result['resumed_from']}; "
          f"reference {result['reference_wall_s']} s; {'PASS' if result['ok'] else 'FAIL'}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 1 if args.check and not result["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
