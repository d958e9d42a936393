"""Smoke tests of the local Slurm test cluster itself (tests/slurm_cluster.py).

If these fail, every launch test after them is suspect: read `<cluster folder>/log/` first.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from slurm_cluster import SlurmCluster, SlurmClusterError, is_alive, poll, process_state

pytest_plugins = ["slurm_fixture"]  # harmless once tests/conftest.py loads it too
pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
PRINT_TASK_ENV = (
    'echo "$SLURM_PROCID $SLURM_NTASKS $SLURMD_NODENAME ${CUDA_VISIBLE_DEVICES:-none}"')


def parse_task_lines(text: str) -> dict[int, tuple[int, str, str]]:
    """`procid ntasks node gpus` lines into {procid: (ntasks, node, gpus)}."""
    tasks = {}
    for line in text.strip().splitlines():
        procid, ntasks, node, gpus = line.split()
        tasks[int(procid)] = (int(ntasks), node, gpus)
    return tasks


def assert_two_by_two(tasks: dict[int, tuple[int, str, str]]) -> None:
    assert sorted(tasks) == [0, 1, 2, 3]
    assert {ntasks for ntasks, _, _ in tasks.values()} == {4}
    assert sorted(node for _, node, _ in tasks.values()) == ["node1", "node1", "node2", "node2"]
    for procid, (_, _, gpus) in tasks.items():
        assert gpus.isdigit(), f"task {procid} sees CUDA_VISIBLE_DEVICES={gpus!r}, want one GPU"
    for node in ("node1", "node2"):
        on_node = [gpus for _, n, gpus in tasks.values() if n == node]
        assert len(set(on_node)) == 2, f"tasks on {node} share a GPU: {on_node}"


def command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def restarts(cluster: SlurmCluster, jobid: str) -> int:
    info = cluster.job_info(jobid) or {}
    return int(info.get("Restarts", "0"))


def test_nodes_are_idle_with_fake_gpus(slurm_cluster: SlurmCluster) -> None:
    assert slurm_cluster.node_states() == {"node1": "idle", "node2": "idle"}
    gres = slurm_cluster.run(["sinfo", "-h", "-N", "-o", "%N %G"]).stdout.split("\n")
    assert all("gpu:4" in line for line in gres if line)


def test_srun_two_nodes_two_tasks_each(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run(["srun", "-N2", "--ntasks-per-node=2", "--gpus-per-task=1",
                             "bash", "-c", PRINT_TASK_ENV], timeout_s=30).stdout
    assert_two_by_two(parse_task_lines(out))


def test_sbatch_job_completes_and_sacct_reports_it(slurm_cluster: SlurmCluster,
                                                    tmp_path: Path) -> None:
    output = tmp_path / "out.txt"
    jobid = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=2", "--gpus-per-task=1", f"--output={output}",
        script=f"#!/bin/bash\nsrun bash -c '{PRINT_TASK_ENV}'\n")
    assert slurm_cluster.wait_job(jobid, "COMPLETED", timeout_s=30) == "COMPLETED"
    assert_two_by_two(parse_task_lines(output.read_text()))
    assert slurm_cluster.wait_job(jobid, "COMPLETED", timeout_s=30, source="sacct") == "COMPLETED"


def test_high_partition_preempts_and_requeues_low(slurm_cluster: SlurmCluster,
                                                   tmp_path: Path) -> None:
    """The preempted job gets its --signal at once, then is requeued after GraceTime=10 s."""
    output = tmp_path / "low.out"
    low = slurm_cluster.sbatch(
        "-p", "low", "-N2", "--exclusive", "--signal=B:USR1@60", f"--output={output}",
        "--open-mode=append",
        script="#!/bin/bash\ntrap 'echo got USR1' USR1\nwhile true; do sleep 0.2; done\n")
    try:
        slurm_cluster.wait_job(low, "RUNNING", timeout_s=30)
        high = slurm_cluster.sbatch("-p", "high", "-N2", "--exclusive", "--wrap", "sleep 1")
        slurm_cluster.wait_job(high, {"RUNNING", "COMPLETED"}, timeout_s=40)
        assert restarts(slurm_cluster, low) == 1
        assert slurm_cluster.job_state(low) in {"PENDING", "REQUEUED", "RUNNING"}
        assert "got USR1" in output.read_text()
        slurm_cluster.wait_job(high, "COMPLETED", timeout_s=30)
    finally:
        slurm_cluster.run(["scancel", low])
    assert slurm_cluster.wait_job(low, "CANCELLED", timeout_s=30) == "CANCELLED"


def test_scontrol_requeue_runs_the_job_again(slurm_cluster: SlurmCluster) -> None:
    jobid = slurm_cluster.sbatch("-N1", "--wrap", "sleep 300")
    try:
        slurm_cluster.wait_job(jobid, "RUNNING", timeout_s=30)
        slurm_cluster.run(["scontrol", "requeue", jobid])
        poll(lambda: True if restarts(slurm_cluster, jobid) == 1 else None, 10,
             f"job {jobid} to count a restart")
        slurm_cluster.wait_job(jobid, "RUNNING", timeout_s=40)  # cred_expire=10 s delays it
    finally:
        slurm_cluster.run(["scancel", jobid])
    slurm_cluster.wait_job(jobid, "CANCELLED", timeout_s=30)
    assert slurm_cluster.wait_job(jobid, "CANCELLED", timeout_s=30, source="sacct") == "CANCELLED"


def test_wait_job_fails_fast_on_an_unexpected_end(slurm_cluster: SlurmCluster) -> None:
    jobid = slurm_cluster.sbatch("--wrap", "exit 3")
    with pytest.raises(SlurmClusterError, match="ended FAILED"):
        slurm_cluster.wait_job(jobid, "COMPLETED", timeout_s=30)


def test_script_starts_and_stops_a_cluster_with_nothing_left(tmp_path: Path) -> None:
    """A second, separate cluster through scripts/slurm-cluster; stopped with a job running."""
    script = [sys.executable, str(REPO / "scripts" / "slurm-cluster")]
    folder = tmp_path / "c"
    started = subprocess.run([*script, "start", str(folder), "--no-accounting"],
                             capture_output=True, text=True, timeout=90, check=False)
    cluster = SlurmCluster.attach(folder)
    try:
        assert started.returncode == 0, started.stderr
        assert f"export SLURM_CONF={folder / 'etc' / 'slurm.conf'}" in started.stdout
        status = subprocess.run([*script, "status", str(folder)], capture_output=True,
                                text=True, timeout=30, check=False)
        assert status.returncode == 0, status.stdout + status.stderr
        jobid = cluster.sbatch("-N2", "--wrap", "srun sleep 300")
        cluster.wait_job(jobid, "RUNNING", timeout_s=30)
        poll(lambda: True if any(command(p).startswith("/") and command(p).split()[0]
                                 .endswith("/sleep") for p in cluster.leftover_pids()) else None,
             10, "the job's `sleep` tasks to start")
    finally:
        stopped = subprocess.run([*script, "stop", str(folder)], capture_output=True,
                                 text=True, timeout=60, check=False)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert cluster.live_pids() == {}
    for name, pid in cluster.pids.items():
        assert not is_alive(pid), f"{name} (pid {pid}) is {process_state(pid)}"
    status = subprocess.run([*script, "status", str(folder)], capture_output=True, text=True,
                            timeout=30, check=False)
    assert status.returncode == 1


def test_rendered_gpu_binding_shows_each_task_its_nodes_gpus(slurm_cluster: SlurmCluster,
                                                             tmp_path: Path) -> None:
    """The rendered srun options (--gpus-per-node on the step, no per-task binding): every task
    sees all GPUs of its node and the runtime's pick by local rank gives each a distinct one
    (issue 12 item 6: peer-to-peer between a node's ranks needs their GPUs visible)."""
    from hpctrain.runtime.distributed import _gpu_index

    output = tmp_path / "out.txt"
    jobid = slurm_cluster.sbatch(
        "-N2", "--ntasks-per-node=2", "--gpus-per-node=2", f"--output={output}",
        script="#!/bin/bash\nsrun --ntasks-per-node=2 --distribution=block:block --gpus-per-node=2 "
               "bash -c 'echo \"$SLURM_PROCID $SLURM_LOCALID $SLURMD_NODENAME ${CUDA_VISIBLE_DEVICES:-none}\"'\n")
    assert slurm_cluster.wait_job(jobid, "COMPLETED", timeout_s=30) == "COMPLETED"
    picked: dict[str, list[int]] = {}
    for line in output.read_text().strip().splitlines():
        _, local, node, visible = line.split()
        gpus = visible.split(",")
        assert len(gpus) == 2, f"task {local} on {node} sees CUDA_VISIBLE_DEVICES={visible!r}, want both"
        picked.setdefault(node, []).append(_gpu_index(int(local), len(gpus)))
    assert {node: sorted(ids) for node, ids in picked.items()} == {"node1": [0, 1], "node2": [0, 1]}
