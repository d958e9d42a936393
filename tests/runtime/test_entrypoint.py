"""`python -m hpctrain.runtime`: launcher detection, exit codes, the files of a run directory."""

from __future__ import annotations

import json
import os
import socket

import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime.distributed import DistEnv, detect_env, first_host, port_for_job

from ._dist import run_distributed
from ._entry import events, make_job, metrics, run_module, write_job

SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4242",
         "SLURM_JOB_NODELIST": "gpu[003-004]"}
TORCHRUN = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "MASTER_ADDR": "node7", "MASTER_PORT": "29400"}


@pytest.mark.parametrize(
    ("environ", "want"),
    [
        ({}, DistEnv(0, 1, 0, "127.0.0.1", 0, "single")),
        (TORCHRUN, DistEnv(5, 16, 5, "node7", 29400, "torchrun")),
        ({**SLURM, **TORCHRUN}, DistEnv(5, 16, 5, "node7", 29400, "torchrun")),  # torchrun inside srun
        (SLURM, DistEnv(3, 8, 1, "gpu003", port_for_job("4242"), "slurm")),
        ({**SLURM, "MASTER_PORT": "31000", "MASTER_ADDR": "head"}, DistEnv(3, 8, 1, "head", 31000, "slurm")),
        ({**SLURM, "SLURM_RESTART_COUNT": "2"}, DistEnv(3, 8, 1, "gpu003", port_for_job("4242", 2), "slurm", 2)),
        ({**SLURM, "SLURM_STEP_NODELIST": "b[7-9]"}, DistEnv(3, 8, 1, "b7", port_for_job("4242"), "slurm")),
        # The local supervisor and the Ray driver count attempts from the run directory (the logs' names):
        # a resumed local run is attempt 2 although no Slurm restart count exists (issue 29 item 3).
        ({**TORCHRUN, "HPCTRAIN_ATTEMPT": "2"}, DistEnv(5, 16, 5, "node7", 29400, "torchrun", 2)),
        # The batch script passes its attempt; the port stays Slurm's formula (the script computes the same).
        ({**SLURM, "SLURM_RESTART_COUNT": "1", "HPCTRAIN_ATTEMPT": "3"},
         DistEnv(3, 8, 1, "gpu003", port_for_job("4242", 1), "slurm", 3)),
    ],
    ids=["single", "torchrun", "torchrun-in-srun", "srun", "srun-master-set", "requeued", "step-nodelist",
         "local-attempt", "slurm-attempt"],
)
def test_detect_env(environ: dict[str, str], want: DistEnv) -> None:
    assert detect_env(environ) == want


def test_bad_launcher_values_are_user_errors() -> None:
    with pytest.raises(ConfigError, match="SLURM_PROCID='x' is not an integer"):
        detect_env({**SLURM, "SLURM_PROCID": "x"})


def test_ports_and_hosts() -> None:
    assert port_for_job("4242") == port_for_job("4242") != port_for_job("4243")
    assert port_for_job("4242", 1) != port_for_job("4242", 0)
    assert all(20000 <= port_for_job(str(i), r) < 60000 for i in range(0, 10**6, 9973) for r in range(3))
    assert first_host("gpu[003-005,9],login1") == "gpu003"


def _write(tmp_path, job) -> str:
    return write_job(job, str(tmp_path / "job.yaml"))


def test_user_errors_exit_2_with_one_line_each(tmp_path) -> None:
    proc = run_module(["--job", str(tmp_path / "missing.yaml"), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2 and proc.stderr.strip().endswith("no such file") and "Traceback" not in proc.stderr

    job = make_job()
    job["train"]["micro_batch"] = "auto"
    job["parallel"]["zero"] = "auto"  # dp == 1: not needed, not reported
    proc = run_module(["--job", _write(tmp_path, job), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m hpctrain.runtime: train.micro_batch: got 'auto'; the runtime needs a resolved job: "
        "run `hpctrain plan` (launch writes job.resolved.yaml with every auto filled)"]

    job = make_job()
    job["train"]["stepz"] = 3
    proc = run_module(["--job", _write(tmp_path, job), "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2 and "did you mean 'steps'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_failing_rank_exits_1_and_records_why(tmp_path) -> None:
    # An unexpected error inside the rank (not bad input, which exits 2 before training): a folder
    # where the runtime must write metrics.jsonl.
    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    proc = run_module(["--job", _write(tmp_path, make_job(train={"steps": 1})), "--run-dir", str(run)])
    assert proc.returncode == 1
    assert "failed: IsADirectoryError" in proc.stderr
    failed = [e for e in events(str(run)) if e["event"] == "failed"]
    assert failed and failed[0]["exit_code"] == 1 and "IsADirectoryError" in failed[0]["reason"]
    assert json.load(open(run / "ranks" / "rank-0.json"))["status"] == "failed"


def test_single_process_run_directory(tmp_path) -> None:
    run = tmp_path / "run"
    proc = run_module(["--job", _write(tmp_path, make_job(train={"steps": 3})), "--run-dir", str(run)],
                      env={"SLURM_RESTART_COUNT": "0"})
    assert proc.returncode == 0, proc.stderr
    assert {"job.resolved.yaml", "metrics.jsonl", "events.jsonl", "ranks", "checkpoints"} <= set(os.listdir(run))
    assert [e["event"] for e in events(str(run))] == ["started", "checkpoint saved", "finished"]
    assert [m["step"] for m in metrics(str(run))] == [1, 2, 3]
    summary = json.load(open(run / "ranks" / "rank-0.json"))
    assert summary["status"] == "finished" and summary["peak_memory_bytes"] > 0
    assert summary["param_bytes"] == 4 * summary["param_count_local"]
    assert summary["optimizer_state_bytes"] >= 2 * summary["param_bytes"]  # AdamW: two moments
    assert "step      3 | loss" in proc.stdout


def _slurm_worker(argv: list[str], job_id: str) -> int:
    """Turn the test launcher's torchrun variables into what srun would set, then run main()."""
    rank, world = os.environ.pop("RANK"), os.environ.pop("WORLD_SIZE")
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)
    os.environ.update(SLURM_PROCID=rank, SLURM_NTASKS=world, SLURM_LOCALID=rank, SLURM_JOB_ID=job_id,
                      SLURM_JOB_NODELIST="localhost", SLURM_RESTART_COUNT="1")
    from hpctrain.runtime.__main__ import main

    return main(argv)


def _free_derived_port_job_id() -> str:
    for job_id in range(7000, 9000):
        port = port_for_job(str(job_id), 1)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return str(job_id)
    pytest.skip("no free port among the derived ones")


def test_two_ranks_from_slurm_variables(tmp_path) -> None:
    """Rendezvous from SLURM_* alone: first host of the node list, port derived from the job id."""
    run = tmp_path / "run"
    job = _write(tmp_path, make_job(dp=2, train={"steps": 2}))
    assert run_distributed(_slurm_worker, 2, ["--job", job, "--run-dir", str(run)], _free_derived_port_job_id(),
                           init_process_group=False, timeout_s=120) == [0, 0]
    started = events(str(run))[0]
    assert started["event"] == "started" and started["launcher"] == "slurm" and started["world_size"] == 2
    assert [m["attempt"] for m in metrics(str(run))] == [1, 1]


def test_rank_order_maps_slots_to_global_ranks() -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.plan.placement import rank_order
    from hpctrain.runtime.distributed import DistEnv, place_rank

    order = rank_order(tp=2, pp=2, dp=2, gpus_per_node=4)
    assert order is not None and order[0] == 0
    base = DistEnv(rank=0, world_size=8, local_rank=0, master_addr="n1", master_port=1, launcher="slurm", attempt=0)
    import dataclasses

    ranks = [place_rank(dataclasses.replace(base, rank=slot), order, 4).rank for slot in range(8)]
    assert sorted(ranks) == list(range(8)) and ranks == order
    assert place_rank(base, None, 4) is base
    with pytest.raises(ConfigError, match="first node"):
        place_rank(base, [4, 1, 2, 3, 0, 5, 6, 7], 4)
