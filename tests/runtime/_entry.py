"""Small resolved jobs and ways to run the runtime entry point on them (trainer, data, checkpoint, entry-point tests).

`run_entry(job, run_dir, world)` runs `python -m hpctrain.runtime`'s `main()` on `world` local gloo
ranks through `_dist.run_distributed` (torchrun-style variables, the entry point initialises the
group itself) and returns the exit codes in rank order.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from typing import Any

import yaml

from ._dist import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BASE_JOB: dict[str, Any] = {
    "name": "runtime-test",
    "model": {"preset": "tiny", "layers": 2, "seq_len": 32},
    "train": {"global_batch": 4, "micro_batch": 2, "steps": 6, "precision": "fp32",
              "activation_checkpointing": "none", "log_every": 1,
              "optimizer": {"lr": 0.003, "weight_decay": 0.01}, "lr_schedule": {"warmup_steps": 1}},
    "parallel": {"tp": 1, "pp": 1, "dp": 1, "zero": 2, "schedule": "1f1b", "virtual_stages": 1},
    "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1, "gpu": "cpu"},
    "checkpoint": {"every_steps": 3, "keep_last": 3},
}


def make_job(tp: int = 1, pp: int = 1, dp: int = 1, **sections: dict[str, Any]) -> dict[str, Any]:
    """BASE_JOB with a layout and per-section updates (e.g. train={"steps": 4})."""
    job = copy.deepcopy(BASE_JOB)
    job["parallel"].update(tp=tp, pp=pp, dp=dp)
    job["cluster"]["gpus_per_node"] = tp * pp * dp
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    return job


def write_job(job: dict[str, Any], path: str) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        yaml.safe_dump(job, handle, sort_keys=False)
    return path


def _entry(argv: list[str]) -> int:
    from hpctrain.runtime.__main__ import main

    return main(argv)


def run_entry(job: dict[str, Any], run_dir: str, world: int | None = None, *extra: str,
              timeout_s: float = 150.0, env: dict[str, str] | None = None) -> list[int]:
    """Run the entry point on `world` ranks (default: the job's tp*pp*dp); exit codes per rank. `env`: extra
    variables for the ranks (the ranks fork from a server started earlier: os.environ changes miss them)."""
    p = job["parallel"]
    world = world or p["tp"] * p["pp"] * p["dp"] * p.get("cp", 1)
    os.makedirs(run_dir, exist_ok=True)
    path = write_job(job, os.path.join(os.path.dirname(os.path.abspath(run_dir)),
                                       os.path.basename(run_dir) + ".job.yaml"))
    argv = ["--job", path, "--run-dir", run_dir, *extra]
    return run_distributed(_entry, world, argv, init_process_group=False, timeout_s=timeout_s, env=env)


def run_module(args: list[str], env: dict[str, str] | None = None, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`python -m hpctrain.runtime ARGS` in a fresh process (single-process launcher)."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
             and not k.startswith("SLURM_")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "hpctrain.runtime", *args], capture_output=True, text=True,
                          timeout=timeout_s, env=clean, cwd=REPO)


def metrics(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def events(run_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(run_dir, "events.jsonl"), encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def losses(run_dir: str) -> list[float]:
    return [m["loss"] for m in metrics(run_dir)]


def text_files() -> list[str]:
    """Plain text on this machine, for `hpctrain data prepare`: the licence files (~237 kB on Debian 12), which
    do not change from one commit to the next, so that the loss thresholds of the tests that train on it hold
    for every commit (the README and docs/architecture.md, once part of it, moved them at every edit). The
    repository's documents are added only where the machine has too little text of its own."""
    licenses = "/usr/share/common-licenses"
    found = []
    if os.path.isdir(licenses):
        found = sorted(os.path.join(licenses, n) for n in os.listdir(licenses)
                       if os.path.isfile(os.path.join(licenses, n)))
    if sum(os.path.getsize(f) for f in found) >= 200_000:
        return found
    for name in ("README.md", os.path.join("docs", "architecture.md")):
        path = os.path.join(REPO, name)
        if os.path.isfile(path):
            found.append(path)
    return found


def copy_run(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst
