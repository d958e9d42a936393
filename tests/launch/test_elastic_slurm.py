"""Elastic node ranges on a real 3-node Slurm: start on 3, lose a node, continue on 2 with a new layout.

The session's shared cluster has 2 nodes (tests/slurm_fixture.py); this module starts its own 3-node
one (no accounting: scontrol answers for a job this young) and stops it at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._helpers import REPO, job_id_of, log_tail, run_cli, run_dir_of, status_json, tiny_job, wait_status, write_job

try:  # tests/ is on sys.path under pytest's default import mode
    from slurm_cluster import SlurmCluster
    from slurm_fixture import _unavailable_reason
except ModuleNotFoundError:  # imported as tests.launch.test_elastic_slurm
    from tests.slurm_cluster import SlurmCluster  # type: ignore[no-redef]
    from tests.slurm_fixture import _unavailable_reason  # type: ignore[no-redef]

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
STEPS = 12


@pytest.fixture(scope="module")
def cluster3() -> Iterator[SlurmCluster]:
    reason = _unavailable_reason()
    if reason:
        if os.environ.get("HPCTRAIN_REQUIRE_SLURM") == "1" or os.environ.get("CI"):
            pytest.fail(f"Slurm tests required but cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster(tempfile.mkdtemp(prefix="hpct-slurm3-"), nodes=3, accounting=False)
    cluster.start(timeout_s=90)
    try:
        yield cluster
    finally:
        cluster.stop()


def _losses(run_dir: Path, after_step: int) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {m["step"]: m["loss"] for m in lines if m["step"] > after_step and "loss" in m}


def _complete_steps(run_dir: Path) -> list[int]:
    from hpctrain.rundir.checkpoints import scan

    return [step for step, _ in scan(str(run_dir / "checkpoints")).complete]


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_node_range_replans_after_a_node_is_drained(cluster3: SlurmCluster, tmp_path: Path) -> None:
    env = {**cluster3.client_env(), "PYTHONPATH": str(REPO), "HPCTRAIN_TEST_STEP_DELAY_S": "1.0"}
    job = tiny_job("elastic", executor="slurm", gpus_per_node=1, steps=STEPS,
                   train={"global_batch": 12, "micro_batch": 1},
                   slurm={"cpus_per_task": 1, "max_requeues": 3},
                   checkpoint={"every_steps": 2, "keep_last": 20})
    job["cluster"]["nodes"] = "2-3"
    submitted = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=env, timeout_s=120)
    assert submitted.returncode == 0, submitted.stderr
    run_dir, job_id = run_dir_of(submitted), job_id_of(submitted)
    assert "#SBATCH --nodes=2-3" in (run_dir / "submit" / "job.sbatch").read_text()

    # Started on all 3 nodes; wait for a checkpoint, then lose node3 and requeue.
    deadline = time.monotonic() + 180
    while not any(step >= 4 for step in _complete_steps(run_dir)):
        info = cluster3.job_info(job_id) or {}
        assert info.get("JobState") not in TERMINAL, f"job ended early: {info}\n{log_tail(run_dir)}"
        assert time.monotonic() < deadline, f"no checkpoint at step 4 in time\n{log_tail(run_dir)}"
        time.sleep(0.5)
    assert (cluster3.job_info(job_id) or {}).get("NumNodes") == "3"
    cluster3.run(["scontrol", "update", "nodename=node3", "state=drain", "reason=elastic-test"])
    cluster3.run(["scontrol", "requeue", job_id])
    status = wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 300, "the requeued job to finish")
    assert status["state"] == "COMPLETED", f"{status}\n{log_tail(run_dir)}"

    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]
    changes = [e for e in events if e["event"] == "layout_changed"]
    assert len(changes) == 1, events
    assert (changes[0]["old"]["nodes"], changes[0]["old"]["dp"]) == (3, 3), changes
    assert (changes[0]["new"]["nodes"], changes[0]["new"]["dp"]) == (2, 2), changes
    assert changes[0]["new"]["grad_accumulation"] == 6 and changes[0]["old"]["grad_accumulation"] == 4
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed, events
    resumed_step = int(resumed[-1]["step"])
    assert 4 <= resumed_step < STEPS
    starts = [e for e in events if e["event"] == "started"]
    assert [e["world_size"] for e in starts][-1] == 2 and starts[0]["world_size"] == 3, starts

    # status shows both layouts (JSON and the table).
    shown = status_json(run_dir, env)
    assert [(lay["nodes"], lay["dp"]) for lay in shown["layouts"]] == [(3, 3), (2, 2)], shown["layouts"]
    table = run_cli(["status", str(run_dir)], cwd=tmp_path, env=env, timeout_s=60)
    assert "layouts:" in table.stdout and "nodes=3 tp=1 pp=1 dp=3" in table.stdout, table.stdout
    assert "nodes=2 tp=1 pp=1 dp=2" in table.stdout, table.stdout

    # The reference: an uninterrupted run on the new layout (2 x 1, local) from the same checkpoint.
    ref = tmp_path / "reference"
    shutil.copytree(run_dir, ref)
    for folder in (ref / "checkpoints").iterdir():
        if folder.name.startswith("step-") and int(folder.name.split("-")[1].split(".")[0]) > resumed_step:
            shutil.rmtree(folder)
    local_env = {k: v for k, v in env.items() if k not in ("HPCTRAIN_TEST_STEP_DELAY_S",)}
    again = run_cli(["resume", str(ref), "--set", "cluster.executor=local", "--set", "cluster.nodes=2"],
                    cwd=tmp_path, env=local_env, timeout_s=60)
    assert again.returncode == 0, again.stderr
    wait_status(ref, local_env, lambda s: s["state"] in TERMINAL, 240, "the reference run")
    elastic_losses, reference = _losses(run_dir, resumed_step), _losses(ref, resumed_step)
    assert sorted(elastic_losses) == list(range(resumed_step + 1, STEPS + 1)), elastic_losses
    assert sorted(reference) == sorted(elastic_losses), (reference, log_tail(ref))
    worst = max(abs(elastic_losses[s] - reference[s]) for s in elastic_losses)
    assert worst <= 1e-5, (elastic_losses, reference)
