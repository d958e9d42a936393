"""Issue 28 on the real test Slurm (tests/slurm_cluster.py): your own script under `hpctrain submit/sweep`.

- examples/own-script/train.py, 2 nodes x 2 tasks (gloo), gets the requeue signal once (`scancel
  --signal=USR2`, what sbatch --signal and a preemption's notice do): it saves, exits 0, the batch script's
  exit path requeues it, and the second attempt resumes from the script's own checkpoint; every step once;
- a script that exits 2 ends FAILED, never requeued, with the reason in `status`;
- a 4-point sweep over a script argument is one array job.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.rundir.events import WHY_NOT_REQUEUED

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "own-script"
CLI = [sys.executable, "-m", "hpctrain"]


def _cli(args: list[str], env: dict[str, str], cwd: Path, timeout_s: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def _wait(check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def _job(name: str, entrypoint: dict[str, Any], nodes: int = 2, gpus_per_node: int = 2) -> dict[str, Any]:
    return {"name": name, "entrypoint": entrypoint,
            "cluster": {"executor": "slurm", "gpu": "cpu", "nodes": nodes, "gpus_per_node": gpus_per_node},
            "slurm": {"partition": "low", "time": "00:10:00", "exclusive": False},
            "restart": {"max_requeues": 2, "grace_s": 30}}


def _submit(tmp_path: Path, env: dict[str, str], job: dict[str, Any], command: str = "submit") -> tuple[Path, str]:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    result = _cli([command, "job.yaml"], env, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = Path(re.search(r"^run (.+)$", result.stdout, re.M).group(1))  # type: ignore[union-attr]
    return run_dir, re.search(r"^job (\S+)$", result.stdout, re.M).group(1)  # type: ignore[union-attr]


def _status(run_dir: Path, env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    result = _cli(["status", str(run_dir), "--json"], env, tmp_path)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text(errors='replace')[-3000:]}"
                     for p in sorted([*run_dir.rglob("*.log"), *run_dir.rglob("slurm-*.out")]))


@pytest.fixture
def env(slurm_cluster: Any) -> dict[str, str]:
    return {**slurm_cluster.client_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(400)
def test_example_is_preempted_once_requeued_and_resumes_from_its_checkpoint(slurm_cluster: Any, env: dict[str, str],
                                                                            tmp_path: Path) -> None:
    job = _job("own-script", {"script": str(EXAMPLE / "train.py"),
                              "args": ["--steps", "16", "--save-every", "100", "--step-delay", "0.4"]})
    run_dir, jobid = _submit(tmp_path, env, job)

    def steps() -> list[int]:
        try:
            return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        except (OSError, ValueError):
            return []
    _wait(lambda: len(steps()) >= 3, 180, "3 steps logged")
    slurm_cluster.run(["scancel", "--signal=USR2", jobid])  # to every rank, as sbatch --signal does
    status = _wait(lambda: (lambda s: s if s["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None)(
        _status(run_dir, env, tmp_path)), 240, "the job to end")
    assert status["state"] == "COMPLETED", json.dumps(status)[:2000] + _logs(run_dir)
    assert (slurm_cluster.job_info(jobid) or {}).get("Restarts") == "1"
    assert steps() == list(range(16)), steps()  # every step once
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert len(saved) == 1, saved  # the save at the signal (--save-every 100 saves nothing else)
    stopped_at = int(saved[0].split("-")[1].split(".")[0])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {m["attempt"] for m in metrics if m["step"] <= stopped_at} == {0}
    assert {m["attempt"] for m in metrics if m["step"] > stopped_at} == {1}
    resumed = (run_dir / "logs" / "rank-0.attempt-1.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / saved[0]} (attempt 1)" in resumed, resumed
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    requeued = [e for e in events if e["event"] == "requeued"]
    assert [(e["reason"], e["attempt"]) for e in requeued] == [("runtime-requested", 0)], events
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.attempt-1.log")) == [
        f"rank-{r}.attempt-1.log" for r in range(4)]
    out = next(run_dir.glob("slurm-*.out")).read_text()
    assert "the runtime asked to be requeued: signal USR2; the program exited 0 after SIGTERM (saved)" in out, out


@pytest.mark.timeout(300)
def test_a_script_that_exits_2_fails_without_requeue(slurm_cluster: Any, env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "refuse.py").write_text("import sys\nprint('refusing my input', flush=True)\nsys.exit(2)\n")
    run_dir, jobid = _submit(tmp_path, env, _job("refuse", {"script": "refuse.py"}))
    status = _wait(lambda: (lambda s: s if s["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None)(
        _status(run_dir, env, tmp_path)), 180, "the job to end")
    assert status["state"] == "FAILED", status
    assert status["reason"] == f"not requeued: {WHY_NOT_REQUEUED['bad-input']}", status
    assert (slurm_cluster.job_info(jobid) or {}).get("Restarts", "0") == "0"
    marker = (run_dir / "bad-input").read_text()
    assert "the program exited 2 (bad input)" in marker
    # The first rank to exit 2 ends the step (srun kills the others, which may not have printed yet under
    # load): its own log holds the program's output.
    refusing = re.search(r"rank (\d+): the program exited 2", marker)
    assert refusing, marker
    log = run_dir / "logs" / f"rank-{refusing.group(1)}.attempt-0.log"
    assert "refusing my input" in log.read_text(), _logs(run_dir)


@pytest.mark.timeout(300)
def test_a_sweep_over_a_script_argument_is_one_array(slurm_cluster: Any, env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "echo.py").write_text("import os, sys\nopen(os.path.join(os.environ['HPCTRAIN_RUN_DIR'], 'arg.txt'), "
                                      "'w').write(sys.argv[2])\n")
    job = _job("sweep", {"script": "echo.py", "args": ["--lr", "0.1"]}, nodes=1, gpus_per_node=1)
    lrs = ["0.1", "0.2", "0.3", "0.4"]
    job["sweep"] = {"grid": {"entrypoint.args": [["--lr", lr] for lr in lrs]}, "max_parallel": 4}
    run_dir, array_id = _submit(tmp_path, env, job, command="sweep")
    assert "_" not in array_id  # one array job

    def ended() -> Any:
        status = _status(run_dir, env, tmp_path)
        done = all(t["state"] in ("COMPLETED", "FAILED", "CANCELLED") for t in status["tasks"])
        return status if done and len(status["tasks"]) == 4 else None
    status = _wait(ended, 240, "the 4 tasks to end")
    assert [t["state"] for t in status["tasks"]] == ["COMPLETED"] * 4, status["tasks"]
    assert [(run_dir / "tasks" / str(i) / "arg.txt").read_text() for i in range(4)] == lrs
    assert {t["job_id"] for t in status["tasks"]} == {f"{array_id}_{i}" for i in range(4)}
