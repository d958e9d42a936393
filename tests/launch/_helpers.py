"""Helpers of the launch tests: the CLI as a subprocess, tiny jobs, and a probe of what each rank sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

REPO = Path(__file__).resolve().parents[2]
# `hpctrain` as a user runs it.
CLI = [sys.executable, "-c",
       "import sys; from hpctrain.cli import main; sys.exit(main())"]

# Imported by every Python process of a job through PYTHONPATH: each runtime rank records its
# environment (read from /proc, so before any of hpctrain runs) into HPCTRAIN_PROBE_DIR.
PROBE_SITECUSTOMIZE = '''
import json, os
_dir = os.environ.get("HPCTRAIN_PROBE_DIR")
if _dir:
    try:
        _argv = open("/proc/self/cmdline", "rb").read().decode(errors="replace").split("\\0")
        if "hpctrain.runtime" in _argv:
            _keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                     "CUDA_VISIBLE_DEVICES", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURMD_NODENAME",
                     "SLURM_JOB_NODELIST", "SLURM_JOB_ID", "SLURM_ARRAY_TASK_ID")
            _keys += tuple(k for k in os.environ.get("HPCTRAIN_PROBE_KEYS", "").split(",") if k)
            with open(os.path.join(_dir, "%d.json" % os.getpid()), "w") as _f:
                json.dump({"argv": _argv, "env": {k: os.environ.get(k) for k in _keys}}, _f)
    except OSError:
        pass
'''

def tiny_job(name: str, *, executor: str = "auto", nodes: int = 1, gpus_per_node: int = 1, steps: int = 3,
             gpu: str = "a100-80gb", **sections: Any) -> dict[str, Any]:
    """A job that trains the tiny preset for a few steps on CPU (gloo)."""
    job: dict[str, Any] = {
        "name": name,
        "model": {"preset": "tiny"},
        "train": {"global_batch": 8, "micro_batch": 1, "steps": steps, "precision": "fp32",
                  "activation_checkpointing": "none", "log_every": 1, "lr_schedule": {"warmup_steps": 0}},
        "parallel": {"tp": 1, "pp": 1},
        "cluster": {"executor": executor, "nodes": nodes, "gpus_per_node": gpus_per_node, "gpu": gpu},
        "slurm": {"partition": "low", "time": "00:10:00", "exclusive": False},
        "checkpoint": {"every_steps": 1000},
    }
    if gpu != "cpu":  # planned for that GPU, trained here on the CPU: said so, or the runtime refuses (exit 2)
        job["runtime"] = {"allow_cpu": True}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    return job


def write_job(folder: Path, job: dict[str, Any]) -> Path:
    path = folder / f"{job['name']}.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def probe_env(folder: Path) -> tuple[dict[str, str], Path]:
    """Environment additions that make every rank record what it sees, and the folder the records go to."""
    site = folder / "probe-site"
    records = folder / "probes"
    site.mkdir(parents=True, exist_ok=True)
    records.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(PROBE_SITECUSTOMIZE)
    # The tree under test stays importable when PYTHONPATH already points at it.
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "HPCTRAIN_PROBE_DIR": str(records)}, records


def read_probes(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text())["env"] for p in sorted(folder.glob("*.json"))]


def run_cli(args: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([*CLI, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"hpctrain {' '.join(args)} did not finish in {timeout_s:g} s:\n{exc.stderr}") from None


def run_dir_of(result: subprocess.CompletedProcess[str]) -> Path:
    lines = [line for line in result.stdout.splitlines() if line.startswith("run ")]
    assert lines, f"no run directory printed:\n{result.stdout}\n{result.stderr}"
    return Path(lines[-1][4:])


def job_id_of(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stdout.splitlines() if line.startswith("job ")]
    assert lines, f"no job id printed:\n{result.stdout}\n{result.stderr}"
    return lines[-1][4:]


def status_json(run_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    result = run_cli(["status", str(run_dir), "--json"], cwd=run_dir.parent, env=env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_status(run_dir: Path, env: dict[str, str], done: Callable[[dict[str, Any]], bool], timeout_s: float,
                what: str) -> dict[str, Any]:
    """Poll `hpctrain status --json` until done(status); fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    status: Optional[dict[str, Any]] = None
    while time.monotonic() < deadline:
        status = status_json(run_dir, env)
        if done(status):
            return status
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last status:\n"
                         f"{json.dumps(status, indent=1)[:3000]}")


def log_tail(run_dir: Path, lines: int = 40) -> str:
    """The end of every log of a run, for assertion messages."""
    parts = []
    for path in sorted([*run_dir.rglob("*.log"), *run_dir.rglob("slurm-*.out")]):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path}\n" + "\n".join(text))
    return "\n".join(parts)
