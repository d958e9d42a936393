"""Build recorded-telemetry run directories for the doctor tests (the shapes the runtime writes).

A run is planned with the real planner (job.yaml + job.resolved.yaml as launch writes them); its
metrics, rank summaries, events and logs are written from a few numbers, so each test states the
one thing that is wrong with its run.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from hpctrain.config import dump_job, job_from_dict
from hpctrain.plan.planner import resolve_job

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 2**30
T0 = 1_700_000_000.0  # a fixed "start" time for events


def gpu_job(**sections: Any) -> dict[str, Any]:
    """A Llama-3-1B-shaped job on one 8 x A100 node, every layout dimension pinned by `sections`."""
    job: dict[str, Any] = {
        "name": "doctor-test",
        "model": {"preset": "llama3-1b", "seq_len": 4096},
        "train": {"global_batch": 64, "micro_batch": 2, "precision": "bf16", "steps": 100, "log_every": 1,
                  "activation_checkpointing": "selective"},
        "parallel": {"tp": 2, "pp": 1, "dp": 4, "zero": 2, "offload_optimizer": False},
        "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 8, "gpu": "a100-80gb", "node": "dgx-a100",
                    "fabric": "ib-hdr200"},
        "checkpoint": {"every_steps": 50},
        "slurm": {"max_requeues": 3},
    }
    for name, values in sections.items():
        job[name] = {**job.get(name, {}), **values}
    return job


def metrics_lines(steps: int, step_time_s: float, *, comm_s: float = 0.0, bubble_s: float = 0.0,
                  tokens_per_step: int = 64 * 4096, mfu: Optional[float] = None, tflops: Optional[float] = None,
                  peak_bytes: float = 20 * GIB, attempt: int = 0, first_step: int = 1) -> list[dict[str, Any]]:
    out = []
    for step in range(first_step, first_step + steps):
        out.append({"step": step, "loss": 10.0 / (1 + 0.05 * step), "lr": 3e-4, "grad_norm": 1.0,
                    "tokens": step * tokens_per_step, "step_time_s": step_time_s,
                    "tokens_per_s": tokens_per_step / step_time_s, "tflops_per_gpu": tflops, "mfu": mfu,
                    "peak_memory_bytes": peak_bytes, "time_compute_s": step_time_s - comm_s - bubble_s,
                    "time_comm_exposed_s": comm_s, "time_bubble_s": bubble_s, "attempt": attempt})
    return out


def rank_summary(rank: int, *, step_time_s: float, compute_s: Optional[float] = None, comm_s: float = 0.0,
                 bubble_s: float = 0.0, peak_bytes: float = 20 * GIB, host: str = "node1", attempt: int = 0,
                 coords: Optional[dict[str, int]] = None, steps: int = 20) -> dict[str, Any]:
    summary = {"rank": rank, "world_size": 8, "host": host, "attempt": attempt, "device": f"cuda:{rank % 8}",
               "status": "finished", "steps_timed": steps, "step_time_s": step_time_s,
               "time_compute_s": compute_s if compute_s is not None else step_time_s - comm_s - bubble_s,
               "time_comm_exposed_s": comm_s, "time_bubble_s": bubble_s, "peak_memory_bytes": peak_bytes,
               "param_bytes": 2 * GIB, "grad_bytes": GIB, "optimizer_state_bytes": 2 * GIB}
    if coords is not None:
        summary["coords"] = coords
    return summary


def event(name: str, dt_s: float, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + dt_s, "event": name, **fields}


def make_run(root: Path, job: dict[str, Any], *, metrics: Sequence[dict[str, Any]] = (),
             ranks: Sequence[dict[str, Any]] = (), events: Optional[list[dict[str, Any]]] = None,
             logs: Optional[dict[tuple[int, int], str]] = None, local_state: Optional[dict[str, Any]] = None,
             metrics_age_s: Optional[float] = None, name: str = "run") -> Path:
    """A run directory under root; `logs` maps (rank, attempt) to text or to a fixtures/logs file name."""
    run_dir = root / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "submit").mkdir()
    validated = job_from_dict(job)
    resolved, _ = resolve_job(validated)
    (run_dir / "job.yaml").write_text(dump_job(validated))
    (run_dir / "job.resolved.yaml").write_text(dump_job(resolved))
    if events is None:
        events = [event("started", 1.0, attempt=0, hosts=["node1"]), event("finished", 3600.0, attempt=0, step=100)]
    _jsonl(run_dir / "events.jsonl", events)
    if metrics:
        _jsonl(run_dir / "metrics.jsonl", metrics)
        if metrics_age_s is not None:
            stamp = time.time() - metrics_age_s
            os.utime(run_dir / "metrics.jsonl", (stamp, stamp))
    if ranks:
        (run_dir / "ranks").mkdir()
        for summary in ranks:
            (run_dir / "ranks" / f"rank-{summary['rank']}.json").write_text(json.dumps(summary))
    for (rank, attempt), text in (logs or {}).items():
        source = FIXTURES / "logs" / text
        body = source.read_text() if text.endswith(".log") and source.is_file() else text
        (run_dir / "logs" / f"rank-{rank}.attempt-{attempt}.log").write_text(body)
    if local_state is not None:
        (run_dir / "submit" / "local.json").write_text(json.dumps(local_state))
    return run_dir


def _jsonl(path: Path, records: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def assert_fixes_replan(run_dir: Path, finding: Any) -> None:
    """Every fix of a finding validates and re-plans, on the resolved job and on job.yaml (issue 8)."""
    import yaml

    from hpctrain.plan.planner import plan_job

    resolved = yaml.safe_load((run_dir / "job.resolved.yaml").read_text())
    resolved.pop("placement", None)
    submitted = yaml.safe_load((run_dir / "job.yaml").read_text())
    for fix in finding.fixes:
        for base in (resolved, submitted):
            plan_job(job_from_dict(base, list(fix.sets)))


def healthy_telemetry(world: int = 8, step_time_s: float = 2.2, comm_s: float = 0.1, host: str = "node1",
                      per_node: int = 8) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Metrics and rank summaries of a run that behaves as planned (tp=2 dp=4 gpu_job)."""
    metrics = metrics_lines(20, step_time_s, comm_s=comm_s, mfu=0.42, tflops=135.0)
    ranks = [rank_summary(r, step_time_s=step_time_s, comm_s=comm_s, host=f"node{1 + r // per_node}" if per_node < world
                          else host) for r in range(world)]
    return metrics, ranks
