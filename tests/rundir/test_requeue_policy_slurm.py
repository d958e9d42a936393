"""Issue 11 item 6 on the real test Slurm (tests/slurm_cluster.py): a job whose runtime exits 2 (bad input)
ends FAILED at once, with no requeue, and an event in events.jsonl says why; a GPU job on nodes whose GPUs
torch cannot use is one (issue 29).

The real runtime runs under the rendered script: its --job file is missing, which it refuses with exit 2.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.render import render_script
from hpctrain.rundir.events import WHY_NOT_REQUEUED, append_event, read_events

from tests.launch._helpers import run_cli, run_dir_of, tiny_job, write_job
from tests.render.hostile import BASE_JOB

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def test_bad_input_fails_without_requeue(slurm_cluster: Any, tmp_path: Path) -> None:
    data = copy.deepcopy(BASE_JOB)
    data.update(name="bad-input", monitor={})
    data["cluster"].update(gpu="cpu", nodes=2, gpus_per_node=2)
    data["slurm"].update(setup=[], time="00:05:00", max_requeues=3)
    data["runtime"] = {**data.get("runtime", {}), "python": sys.executable}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_script(job_from_dict(data), run_dir=str(run_dir))  # no job.resolved.yaml: the ranks exit 2
    env = dict(slurm_cluster.client_env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    jobid = subprocess.run(["sbatch", "--parsable"], input=script, env=env, capture_output=True, text=True,
                           timeout=30, check=True).stdout.strip()
    try:
        state = slurm_cluster.wait_job(jobid, ("FAILED", "COMPLETED", "REQUEUED", "PENDING_REQUEUE"), timeout_s=120)
    finally:
        slurm_cluster.run(["scancel", jobid], check=False)
    output = (run_dir / f"slurm-{jobid}.out").read_text()
    assert state == "FAILED", output
    info = slurm_cluster.job_info(jobid) or {}
    assert info.get("Restarts", "0") == "0", info
    assert "not requeued: a rank exited 2 (bad input)" in output and "requeueing" not in output, output
    assert "--job" in (run_dir / "bad-input").read_text()  # the runtime's own line, per rank
    [event] = [e for e in read_events(run_dir) if e.get("source") == "batch-script"]
    assert (event["event"], event["why_not"], event["attempt"]) == ("not_requeued", "bad-input", 0)
    assert event["why_not"] in WHY_NOT_REQUEUED and event["job_id"] == jobid
    assert sorted(p.name for p in (run_dir / "logs").glob("task-*.log")) == [f"task-{s}.attempt-0.log" for s in range(4)]
    # What `hpctrain submit` records before the job runs (sbatch was called directly here).
    recorded = (run_dir / "events.jsonl").read_text()
    (run_dir / "events.jsonl").unlink()
    append_event(run_dir, "submitted", executor="slurm", job_id=jobid)
    with open(run_dir / "events.jsonl", "a", encoding="utf-8") as handle:
        handle.write(recorded)
    status = subprocess.run([sys.executable, "-m", "hpctrain", "status", str(run_dir), "--json"], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["reason"] == f"not requeued: {WHY_NOT_REQUEUED['bad-input']}", status.stdout
    doctor = subprocess.run([sys.executable, "-m", "hpctrain", "doctor", str(run_dir), "--no-scheduler"], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert doctor.returncode == 1 and "a rank refused the job's input (exit 2); not requeued" in doctor.stdout, doctor


def test_a_gpu_job_on_nodes_without_a_usable_gpu_fails_as_bad_input(slurm_cluster: Any, tmp_path: Path) -> None:
    """Issue 29: the test cluster's GPUs are device files (srun sets CUDA_VISIBLE_DEVICES) and torch here is a
    CPU build: a job planned for A100s must stop with exit 2 and the reason, not train on the CPU, not requeue."""
    job = tiny_job("no-gpu", executor="slurm", gpus_per_node=2, steps=2)
    del job["runtime"]  # no runtime.allow_cpu
    env = dict(slurm_cluster.client_env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    result = run_cli(["submit", str(write_job(tmp_path, job)), "--wait", "--timeout", "150"], cwd=tmp_path, env=env,
                     timeout_s=200)
    run_dir = run_dir_of(result)
    assert result.returncode == 1, result.stdout + result.stderr
    events = read_events(run_dir)
    failed = [e for e in events if e.get("event") == "failed" and e.get("exit_code") == 2]
    assert failed, events  # from whichever rank refused first (the others are killed with it)
    assert all(e["reason"].startswith("cluster.gpu: 'a100-80gb' but this rank has no usable CUDA device: this "
                                      "torch is a CPU-only build") for e in failed), failed
    assert [(e["event"], e["why_not"]) for e in events if e.get("source") == "batch-script"] == [
        ("not_requeued", "bad-input")]
    assert not (run_dir / "metrics.jsonl").exists()
    assert not [e for e in events if e.get("event") == "started"]
