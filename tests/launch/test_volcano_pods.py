"""Volcano pods simulated as local processes (issue 17, acceptance 3).

Each "pod" is the rendered manifest's own container command and environment, run here, plus what
Volcano would add to a pod: the env plugin's VC_TASK_INDEX / VK_TASK_INDEX and the svc plugin's
VC_WORKER_HOSTS, VC_WORKER_NUM or /etc/volcano/worker.host (a folder of ours, HPCTRAIN_VOLCANO_DIR).
The hostnames are `localhost`: Volcano's `<job>-worker-<i>.<job>` names resolve only inside the cluster.
2 pods x 2 ranks on gloo. A pod is killed as a whole (its process group, as the kubelet kills a
container), and the Job restarted as RestartJob does: every pod replaced, same volume.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError
from hpctrain.render.vcjob import vcjob_manifest
from hpctrain.rundir.checkpoints import scan
from hpctrain.rundir.events import read_events
from hpctrain.rundir.metrics import read_metrics
from hpctrain.rundir.ports import free_port
from hpctrain.rundir.volcano import HOSTS_DIR_ENV, PodRendezvous, pod_attempt, pod_rendezvous
from hpctrain.runtime.distributed import detect_env

REPO = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.mark.parametrize("environ,files,want", [
    ({"VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": "j-worker-0.j,j-worker-1.j", "VC_WORKER_NUM": "2",
      "MASTER_PORT": "23456"}, [], PodRendezvous(1, 2, "j-worker-0.j", 23456)),
    ({"VK_TASK_INDEX": "0"}, ["j-worker-0.j", "j-worker-1.j", "j-worker-2.j"],
     PodRendezvous(0, 3, "j-worker-0.j", 29500)),
])
def test_pod_rendezvous_from_volcano_variables(environ: dict[str, str], files: list[str], want: PodRendezvous) -> None:
    assert pod_rendezvous(environ, lambda env: files) == want


@pytest.mark.parametrize("environ,message", [
    ({"VC_TASK_INDEX": "x", "VC_WORKER_HOSTS": "a"}, "VC_TASK_INDEX='x' is not a non-negative integer"),
    ({"VC_TASK_INDEX": "0"}, "neither VC_WORKER_HOSTS nor /etc/volcano/worker.host names the pods"),
    ({"VC_TASK_INDEX": "2", "VC_WORKER_HOSTS": "a,b"}, "task index 2 with 2 pod(s)"),
    ({"VC_TASK_INDEX": "0", "VC_WORKER_HOSTS": "a,b", "VC_WORKER_NUM": "3"},
     "task index 0 with 3 pod(s) but 2 host(s)"),
])
def test_pod_rendezvous_refuses_what_volcano_would_not_give(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        pod_rendezvous(environ, lambda env: [])
    assert message in str(info.value)


def test_runtime_reads_a_pod_rank_and_a_bare_pod() -> None:
    launched = {"VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": "a,b", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                "MASTER_ADDR": "a", "MASTER_PORT": "23456", "HPCTRAIN_ATTEMPT": "2"}
    env = detect_env(launched)
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher, env.attempt) == \
        (3, 4, 1, "a", "volcano", 2)
    bare = detect_env({"VC_TASK_INDEX": "1", "VC_WORKER_HOSTS": "a,b"})  # one rank per pod, no launcher
    assert (bare.rank, bare.world_size, bare.master_addr, bare.master_port, bare.launcher) == \
        (1, 2, "a", 29500, "volcano")


def test_pod_attempt_counts_only_its_own_task_logs(tmp_path: Path) -> None:
    assert pod_attempt(tmp_path / "missing", 0) == 0
    for name in ("task-2.attempt-0.log", "task-2.attempt-1.log", "task-0.attempt-4.log", "rank-2.attempt-7.log"):
        (tmp_path / name).write_text("")
    assert pod_attempt(tmp_path, 2) == 2  # pod 1 of 2-GPU pods: slot 2; other pods' files do not count


def volcano_job(mount: Path, port: int) -> Any:
    return job_from_dict({
        "name": "pods", "model": {"preset": "tiny", "layers": 2, "seq_len": 32},
        "train": {"global_batch": 4, "micro_batch": 1, "steps": STEPS, "precision": "fp32",
                  "activation_checkpointing": "none", "log_every": 1,
                  "optimizer": {"lr": 0.003, "weight_decay": 0.01}, "lr_schedule": {"warmup_steps": 1}},
        "parallel": {"tp": 1, "pp": 1, "dp": 4, "zero": 1, "schedule": "1f1b", "virtual_stages": 1},
        "cluster": {"executor": "volcano", "nodes": 2, "gpus_per_node": 2, "gpu": "cpu", "fabric": "ethernet"},
        "checkpoint": {"every_steps": 3, "keep_last": 5},
        "kubernetes": {"image": "unused", "pvc": {"claim_name": "runs", "mount_path": str(mount)},
                       "master_port": port},
    })


def pod_processes(job: Any, run_dir: Path, hosts_dir: Path, extra: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    """Start the Job's pods: the manifest's command and env, plus Volcano's variables for each index."""
    manifest = vcjob_manifest(job, run_dir=str(run_dir))
    task = manifest["spec"]["tasks"][0]
    container = task["template"]["spec"]["containers"][0]
    command = [sys.executable, *container["command"][1:]]  # the image's python3 is this interpreter here
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    base.update(PYTHONPATH=str(REPO), **{e["name"]: e["value"] for e in container["env"]}, **extra)
    procs = []
    for index in range(task["replicas"]):
        env = {**base, "VC_TASK_INDEX": str(index), "VK_TASK_INDEX": str(index),
               "VC_WORKER_NUM": str(task["replicas"]), HOSTS_DIR_ENV: str(hosts_dir)}
        log = open(run_dir.parent / f"pod-{index}.out", "ab")  # what `kubectl logs` would show
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir.parent,
                                      start_new_session=True))  # a pod is its own process group
        log.close()
    return procs


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise
    return [p.returncode for p in procs]


def losses(run_dir: Path) -> dict[int, float]:
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == sorted(set(steps)), f"a step logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def pod_output(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(run_dir.parent.glob("pod-*.out")))


@pytest.mark.timeout(420)
def test_two_pods_train_and_a_killed_pod_restarts_the_job_from_its_checkpoint(tmp_path: Path) -> None:
    hosts = tmp_path / "etc-volcano"
    hosts.mkdir()
    (hosts / "worker.host").write_text("localhost\nlocalhost\n")  # the svc plugin's file form

    # Uninterrupted: two pods of two ranks each complete.
    whole = tmp_path / "a" / "pvc"
    job = volcano_job(whole, free_port())
    run_a = whole / "run"
    run_a.mkdir(parents=True)
    codes = wait_all(pod_processes(job, run_a, hosts, {}), 180)
    assert codes == [0, 0], pod_output(run_a)
    reference = losses(run_a)
    assert sorted(reference) == list(range(1, STEPS + 1))
    started = [e for e in read_events(run_a) if e.get("event") == "started"]
    assert [(e["world_size"], e["launcher"], e["attempt"]) for e in started] == [(4, "volcano", 0)]

    # Interrupted: pod 1 killed after the step-3 checkpoint; RestartJob replaces both pods.
    mount = tmp_path / "b" / "pvc"
    job = volcano_job(mount, free_port())
    run_b = mount / "run"
    run_b.mkdir(parents=True)
    pods = pod_processes(job, run_b, hosts, {"HPCTRAIN_TEST_STEP_DELAY_S": "0.5"})
    deadline = time.monotonic() + 150
    while not scan(str(run_b / "checkpoints")).complete:
        assert time.monotonic() < deadline and all(p.poll() is None for p in pods), pod_output(run_b)
        time.sleep(0.05)
    os.killpg(pods[1].pid, signal.SIGKILL)  # the node or the container dies: launcher and ranks at once
    try:
        pods[0].wait(timeout=60)  # its ranks lose their peers; the launcher stops them and fails the pod
    except subprocess.TimeoutExpired:  # Volcano would delete it anyway (RestartJob): SIGTERM, then SIGKILL
        os.killpg(pods[0].pid, signal.SIGTERM)
        try:
            pods[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pods[0].pid, signal.SIGKILL)
            pods[0].wait()
    pods[1].wait()
    assert pods[1].returncode == -signal.SIGKILL and pods[0].returncode != 0
    killed_at = max(r["step"] for r in read_metrics(run_b) if "loss" in r)
    assert killed_at < STEPS, "the kill came after the last step: nothing to resume"

    codes = wait_all(pod_processes(job, run_b, hosts, {}), 180)  # the restarted Job: new pods, same volume
    assert codes == [0, 0], pod_output(run_b)
    assert losses(run_b) == reference  # every step once, bit-identical to the uninterrupted run
    events = read_events(run_b)
    started = [e for e in events if e.get("event") == "started"]
    assert [e["attempt"] for e in started] == [0, 1]
    finished = [e for e in events if e.get("event") == "finished"]
    assert finished and finished[-1]["resumed_from"] is not None, json.dumps(events)[-2000:]
    assert (run_b / "logs" / "task-2.attempt-1.log").exists()  # pod 1's first slot, second attempt


def test_a_pod_without_volcano_variables_exits_2_with_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VC_", "VK_"))}
    proc = subprocess.run([sys.executable, "-m", "hpctrain.launch.volcano.pod", "--run-dir", str(tmp_path), "--gpus", "2"],
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "VC_TASK_INDEX" in lines[0] and "spec.plugins.env" in lines[0], proc.stderr
