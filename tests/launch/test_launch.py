"""submit, sweep, status, cancel and logs end to end: on the real local Slurm, and with executor local.

Each example runs twice: `slurm` (the session's test cluster, tests/slurm_fixture.py) and `local`
(no Slurm at all: PATH holds no sbatch, SLURM_CONF is unset, executor auto must pick local and say so).
The ranks run the real runtime (`python -m hpctrain.runtime`) on the tiny preset for a few steps.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._helpers import (
    job_id_of,
    log_tail,
    probe_env,
    read_probes,
    run_cli,
    run_dir_of,
    status_json,
    tiny_job,
    wait_status,
    write_job,
)

EXECUTORS = ["local", pytest.param("slurm", marks=pytest.mark.slurm)]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "SUBMIT_FAILED"}


@pytest.fixture
def launch_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    """The environment of the CLI for one executor (see the module docstring)."""
    if request.param == "slurm":
        cluster = request.getfixturevalue("slurm_cluster")
        return cluster.client_env()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)  # python, and no Slurm client
    return env


def _submit(tmp_path: Path, env: dict[str, str], job: dict[str, Any], *args: str,
            timeout_s: float = 180) -> Any:
    return run_cli(["submit", str(write_job(tmp_path, job)), *args], cwd=tmp_path, env=env, timeout_s=timeout_s)


@pytest.mark.parametrize("launch_env", EXECUTORS, indirect=True)
def test_submit_two_nodes_two_tasks(launch_env: dict[str, str], tmp_path: Path) -> None:
    kind = "local" if "SLURM_CONF" not in launch_env else "slurm"
    probe, probes = probe_env(tmp_path)
    env = {**launch_env, **probe}
    result = _submit(tmp_path, env, tiny_job("two-by-two", nodes=2, gpus_per_node=2, steps=3),
                     "--wait", "--timeout", "150")
    run_dir = run_dir_of(result)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{log_tail(run_dir)}"
    assert f"executor: {kind} (cluster.executor auto" in result.stderr
    status = status_json(run_dir, env)
    assert (status["state"], status["step"], status["restarts"]) == ("COMPLETED", 3, 0)
    assert status["job_id"] == job_id_of(result) and status["tokens_per_s"] > 0

    seen = read_probes(probes)
    assert len(seen) == 4, seen
    if kind == "slurm":
        ranks = sorted(int(p["SLURM_PROCID"]) for p in seen)
        assert {p["SLURM_NTASKS"] for p in seen} == {"4"}
        rank0 = next(p for p in seen if p["SLURM_PROCID"] == "0")
        assert rank0["SLURMD_NODENAME"] == "node1"  # rank 0 runs on the first node of the allocation ...
        assert {p["MASTER_ADDR"] for p in seen} == {"127.0.0.1"}  # ... whose address (NodeAddr) every rank dials
        gpus = {p["SLURM_PROCID"]: p["CUDA_VISIBLE_DEVICES"] for p in seen}
        # what `render` shows is byte for byte what sbatch received
        from hpctrain.config import load_job
        from hpctrain.render import render_script

        resolved = load_job(str(run_dir / "job.resolved.yaml"))
        sent = (run_dir / "submit" / f"{status['job_id']}_submission.sh").read_text()
        assert sent == render_script(resolved, run_dir=str(run_dir)) == (run_dir / "submit" / "job.sbatch").read_text()
    else:
        ranks = sorted(int(p["RANK"]) for p in seen)
        assert {(p["WORLD_SIZE"], p["MASTER_ADDR"], p["OMP_NUM_THREADS"]) for p in seen} == {("4", "127.0.0.1", "1")}
        assert sorted(int(p["LOCAL_RANK"]) for p in seen) == [0, 0, 1, 1]
        assert len({p["MASTER_PORT"] for p in seen}) == 1
    assert ranks == [0, 1, 2, 3]
    summaries = [json.loads((run_dir / "ranks" / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [(s["rank"], s["world_size"]) for s in summaries] == [(r, 4) for r in range(4)]
    for name in ("job.yaml", "job.resolved.yaml", "plan.json", "events.jsonl", "metrics.jsonl"):
        assert (run_dir / name).is_file(), name

    logs = run_cli(["logs", str(run_dir), "--rank", "0"], cwd=tmp_path, env=env, timeout_s=30)
    assert logs.returncode == 0 and "step" in logs.stdout, logs.stderr  # rank 0 logs the steps
    if kind == "slurm":  # each task sees its node's 2 fake GPUs (peer access kept); the runtime picks LOCAL_RANK's
        assert set(gpus.values()) == {"0,1"}, f"CUDA_VISIBLE_DEVICES by rank: {gpus}"


@pytest.mark.parametrize("launch_env", EXECUTORS, indirect=True)
def test_sweep_is_one_array(launch_env: dict[str, str], tmp_path: Path) -> None:
    kind = "local" if "SLURM_CONF" not in launch_env else "slurm"
    env = dict(launch_env)
    calls = tmp_path / "sbatch-calls"
    if kind == "slurm":  # count sbatch calls with a wrapper in front of the real one
        wrapper = tmp_path / "bin" / "sbatch"
        wrapper.parent.mkdir()
        real = "/usr/bin/sbatch" if os.path.exists("/usr/bin/sbatch") else "sbatch"
        wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
        wrapper.chmod(0o755)
        env["PATH"] = f"{wrapper.parent}:{env['PATH']}"
    job = tiny_job("grid", steps=2, sweep={"grid": {"train.micro_batch": [1, 2]}, "max_parallel": 2})
    result = run_cli(["sweep", str(write_job(tmp_path, job)), "--grid", "train.micro_batch=1,2,4,8,16",
                      "--wait", "--timeout", "240"], cwd=tmp_path, env=env, timeout_s=300)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"  # --wait: 0 when every task completed
    assert "skipped train.micro_batch=16: no layout" in result.stderr  # the planner's reason
    assert "local batch (global_batch / dp) not divisible by micro_batch" in result.stderr
    run_dir = run_dir_of(result)
    sweep = json.loads((run_dir / "sweep.json").read_text())
    assert sweep["array"] == "0-3%2" and len(sweep["tasks"]) == 4 and len(sweep["skipped"]) == 1
    if kind == "slurm":
        assert len(calls.read_text().splitlines()) == 1  # ONE sbatch call for the whole sweep
        assert "#SBATCH --array=0-3%2" in (run_dir / "submit" / "job.sbatch").read_text()

    summary = result.stdout.splitlines()  # sweep --wait: one line per task when all have ended
    assert summary[-5:] == [f"task {i} train.micro_batch={mb}: COMPLETED at step 2/2"
                            for i, mb in enumerate([1, 2, 4, 8])] + ["4 of 4 tasks completed"], result.stdout
    status = status_json(run_dir, env)
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED"] * 4, log_tail(run_dir)
    assert [t["job_id"] for t in status["tasks"]] == [f"{status['job_id']}_{i}" for i in range(4)]
    for task, micro_batch in zip(status["tasks"], [1, 2, 4, 8]):
        task_dir = Path(task["run_dir"])
        resolved = yaml.safe_load((task_dir / "job.resolved.yaml").read_text())
        assert resolved["train"]["micro_batch"] == micro_batch  # each task its own config
        assert task["step"] == 2 and (task_dir / "metrics.jsonl").is_file()


@pytest.mark.parametrize("launch_env", EXECUTORS, indirect=True)
def test_cancel(launch_env: dict[str, str], tmp_path: Path) -> None:
    result = _submit(tmp_path, launch_env, tiny_job("long", steps=100000), timeout_s=60)
    assert result.returncode == 0, result.stderr
    run_dir = run_dir_of(result)
    wait_status(run_dir, launch_env, lambda s: s["state"] == "RUNNING", 60, "the job to run")
    cancel = run_cli(["cancel", "long", "--runs-dir", str(tmp_path / "runs")], cwd=tmp_path, env=launch_env,
                     timeout_s=30)
    assert cancel.returncode == 0 and f"cancelled job {job_id_of(result)}" in cancel.stdout, cancel.stderr
    status = wait_status(run_dir, launch_env, lambda s: s["state"] in TERMINAL, 60, "the job to end")
    assert status["state"] == "CANCELLED"


@pytest.mark.slurm
def test_bad_partition_is_refused_with_slurms_message(slurm_cluster: Any, tmp_path: Path) -> None:
    env = slurm_cluster.client_env()
    result = _submit(tmp_path, env, tiny_job("refused", slurm={"partition": "nope"}), timeout_s=60)
    assert result.returncode == 3, result.stderr
    assert "invalid partition specified: nope" in result.stderr
    run_dir = run_dir_of_failed(tmp_path)
    status = status_json(run_dir, env)
    assert status["state"] == "SUBMIT_FAILED" and "invalid partition" in status["reason"]


def run_dir_of_failed(tmp_path: Path) -> Path:
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_missing_sbatch_is_a_user_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    result = _submit(tmp_path, env, tiny_job("nosbatch", executor="slurm"), timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert "needs `sbatch` but it is not on PATH" in result.stderr and "executor: local" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()  # nothing was created for a job that cannot be submitted


def test_resume_local_onto_another_layout(tmp_path: Path) -> None:
    """Resubmit a run from its newest complete checkpoint with more steps and dp 2 -> 1: the loss curve
    continues within 1e-5 of what the first layout computed for the same steps."""
    import shutil

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    job = tiny_job("again", gpus_per_node=2, steps=4, checkpoint={"every_steps": 2})
    first = _submit(tmp_path, env, job, "--wait", "--timeout", "120")
    run_dir = run_dir_of(first)
    assert first.returncode == 0, f"{first.stderr}\n{log_tail(run_dir)}"
    before = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir / "checkpoints" / "step-4")  # as if stopped before its last save: steps 3-4 run again
    _dry_runs_leave_the_run_as_it_is(tmp_path, env, run_dir, job)
    again = run_cli(["resume", str(run_dir), "--set", "train.steps=5", "--set", "cluster.gpus_per_node=1"],
                    cwd=tmp_path, env=env, timeout_s=120)
    assert again.returncode == 0, again.stderr
    assert f"resuming from {run_dir / 'checkpoints' / 'step-2'}" in again.stdout
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 120, "the resumed run to end")
    assert (status["state"], status["step"]) == ("COMPLETED", 5), log_tail(run_dir)
    after = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in after] == [1, 2, 3, 4, 5]  # each step once: the resumed run continued at 3
    for old, new in zip(before[2:], after[2:4]):  # steps 3 and 4: dp 2 first, dp 1 after the resume
        assert abs(new["loss"] - old["loss"]) <= 1e-5, (old["step"], old["loss"], new["loss"])
    assert yaml.safe_load((run_dir / "job.resolved.yaml").read_text())["parallel"]["dp"] == 1
    assert (run_dir / "submit" / "previous-1" / "job.resolved.yaml").is_file()  # the first layout is kept


def _tree(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file and folder under folder: its path -> (contents, mtime in ns)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else b"", p.stat().st_mtime_ns)
            for p in [folder, *sorted(folder.rglob("*"))]}


def _dry_runs_leave_the_run_as_it_is(tmp_path: Path, env: dict[str, str], run_dir: Path, job: dict[str, Any]) -> None:
    """`resume --dry-run` with another layout renders into a scratch folder and says what would change;
    `submit --dry-run` and `sweep --dry-run` of the same job into the same runs_dir make runs of their own:
    nothing under run_dir changes (paths, contents, mtimes)."""
    before = _tree(run_dir)
    dry = run_cli(["resume", str(run_dir), "--set", "train.steps=5", "--set", "cluster.gpus_per_node=1",
                   "--dry-run"], cwd=tmp_path, env=env, timeout_s=60)
    assert dry.returncode == 0, dry.stderr
    scratch = Path(dry.stdout.split("new job files in ", 1)[1].splitlines()[0])
    assert not scratch.is_relative_to(run_dir) and (scratch / "submit" / "job.sbatch").is_file()
    assert yaml.safe_load((scratch / "job.resolved.yaml").read_text())["parallel"]["dp"] == 1
    assert f"RUN_DIR={run_dir}\n" in (scratch / "submit" / "job.sbatch").read_text()  # the script the run would get
    assert "would change parallel.dp: 2 -> 1" in dry.stdout and "would change train.steps: 4 -> 5" in dry.stdout
    assert f"would resume from {run_dir / 'checkpoints' / 'step-2'}" in dry.stdout
    path = write_job(tmp_path, {**job, "sweep": {"grid": {"train.seed": [1, 2]}}})
    for command in ("submit", "sweep"):
        other = run_cli([command, str(path), "--dry-run"], cwd=tmp_path, env=env, timeout_s=60)
        assert other.returncode == 0 and run_dir_of(other) != run_dir, other.stderr
    assert _tree(run_dir) == before
    assert status_json(run_dir, env)["state"] == "COMPLETED"


@pytest.mark.slurm
def test_dry_run_writes_everything_but_submits_nothing(slurm_cluster: Any, tmp_path: Path) -> None:
    env = slurm_cluster.client_env()
    result = _submit(tmp_path, env, tiny_job("dry"), "--dry-run", timeout_s=60)
    assert result.returncode == 0 and "dry run: nothing submitted" in result.stdout, result.stderr
    run_dir = run_dir_of(result)
    assert (run_dir / "submit" / "job.sbatch").is_file() and (run_dir / "job.resolved.yaml").is_file()
    assert not list((run_dir / "submit").glob("*_submission.sh"))
    assert status_json(run_dir, env)["state"] == "DRY_RUN"
