"""The script's exit path, executed with stubs: requeue when the runtime asks or a rank crashes, within
restart.max_requeues, the exact job or array task; otherwise say why not, in the log and in events.jsonl.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.render import render_script

from .hostile import BASE_JOB
from .sbatch_parser import option_values
from .stubs import Run, make_stub_dir, run_script


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_stub_dir(tmp_path_factory.mktemp("stubs"))


def _job(**slurm: Any) -> Any:
    data = copy.deepcopy(BASE_JOB)
    data["monitor"] = {}
    data["slurm"].update(setup=[], max_requeues=3, **slurm)
    return job_from_dict(data)


def _run(tmp_path: Path, bin_dir: Path, *, array: str | None = None, **env: str) -> tuple[Run, Path]:
    run_dir = tmp_path / "run"
    task_dir = run_dir / "tasks" / "2" if array else run_dir
    task_dir.mkdir(parents=True)
    script = render_script(_job(), run_dir=str(run_dir), array=array)
    return run_script(script, bin_dir=bin_dir, work=tmp_path, env=env), task_dir


def _events(task_dir: Path) -> list[dict[str, Any]]:
    path = task_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_finished_run_exits_0_without_requeue(tmp_path: Path, bin_dir: Path) -> None:
    run, task_dir = _run(tmp_path, bin_dir)
    assert run.returncode == 0
    assert run.argv_of("scontrol") == [["show", "hostnames", "node[1-2]"], ["-o", "show", "node", "node1"]]
    assert b"hpctrain: training finished (attempt 0)" in run.stdout
    assert _events(task_dir) == []


def test_runtime_request_requeues_the_job(tmp_path: Path, bin_dir: Path) -> None:
    run, task_dir = _run(tmp_path, bin_dir, STUB_REQUEST_REQUEUE="1", SLURM_RESTART_COUNT="1")
    assert run.returncode == 0
    assert ["requeue", "4242"] in run.argv_of("scontrol")
    assert b"the runtime asked to be requeued: signal USR2 at step 7: checkpoint saved" in run.stdout
    assert b"requeueing 4242 (restart 2 of at most 3): runtime-requested" in run.stdout
    [event] = _events(task_dir)
    assert event["event"] == "requeued" and event["reason"] == "runtime-requested"
    assert event["attempt"] == 1 and event["job_id"] == "4242" and event["exit_code"] == 0
    assert event["source"] == "batch-script" and event["time"].endswith("+00:00")
    # ISO 8601 in UTC with milliseconds, as the runtime writes its own events (telemetry._now)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", event["time"]), event["time"]
    assert datetime.datetime.fromisoformat(event["time"]).utcoffset() == datetime.timedelta(0)


def test_crashed_rank_requeues_the_job(tmp_path: Path, bin_dir: Path) -> None:
    run, task_dir = _run(tmp_path, bin_dir, STUB_RANK_RC="3")
    assert run.returncode == 0
    assert ["requeue", "4242"] in run.argv_of("scontrol")
    assert b"srun exited with status 3" in run.stdout
    assert [(e["event"], e["reason"], e["exit_code"]) for e in _events(task_dir)] == [("requeued", "rank-crashed", 3)]


@pytest.mark.parametrize(("env", "status"), [({"STUB_RANK_RC": "3"}, 3), ({"STUB_REQUEST_REQUEUE": "1"}, 1)])
def test_budget_spent_ends_the_job_and_says_why(tmp_path: Path, bin_dir: Path, env: dict[str, str],
                                                status: int) -> None:
    run, task_dir = _run(tmp_path, bin_dir, SLURM_RESTART_COUNT="3", **env)
    assert run.returncode == status
    assert not [a for a in run.argv_of("scontrol") if a[0] == "requeue"]
    assert b"not requeued: 3 of restart.max_requeues=3 requeues used" in run.stderr
    assert [(e["event"], e["why_not"]) for e in _events(task_dir)] == [("not_requeued", "max-requeues-reached")]


def test_failed_scontrol_is_reported_not_ignored(tmp_path: Path, bin_dir: Path) -> None:
    run, task_dir = _run(tmp_path, bin_dir, STUB_RANK_RC="5", STUB_REQUEUE_RC="1")
    assert run.returncode == 5
    assert b"not requeued: scontrol requeue 4242 failed" in run.stderr
    assert [(e["event"], e["why_not"]) for e in _events(task_dir)] == [("requeued", ""),
                                                                        ("not_requeued", "scontrol-failed")]


@pytest.mark.parametrize("env", [{"STUB_RANK_RC": "2"},
                                 # one rank exited 2, srun killed the others: srun's status is theirs
                                 {"STUB_RANK_RC": "137", "STUB_BAD_INPUT": "train.data: no such file"}])
def test_bad_input_is_not_requeued(tmp_path: Path, bin_dir: Path, env: dict[str, str]) -> None:
    """Issue 11 item 6: a rank exiting 2 fails the job at once, saying why, instead of spending requeues."""
    from hpctrain.rundir.events import WHY_NOT_REQUEUED, read_events

    run, task_dir = _run(tmp_path, bin_dir, **env)
    assert run.returncode == 2
    assert not [a for a in run.argv_of("scontrol") if a[0] == "requeue"]
    assert b"hpctrain: not requeued: a rank exited 2 (bad input)" in run.stderr
    if "STUB_BAD_INPUT" in env:
        assert b"rank 3: train.data: no such file" in run.stderr
    [event] = read_events(task_dir)  # the batch script's printf line, read back by the run-dir module
    assert (event["event"], event["reason"], event["why_not"]) == ("not_requeued", "bad-input", "bad-input")
    assert event["why_not"] in WHY_NOT_REQUEUED and event["source"] == "batch-script"


def _metrics_at(task_dir: Path, step: int) -> None:
    (task_dir / "metrics.jsonl").write_text("".join(f'{{"step":{s},"loss":2.5,"attempt":0}}\n'
                                                    for s in range(step - 10, step + 1, 5)))


def test_crash_again_at_the_same_step_is_not_requeued(tmp_path: Path, bin_dir: Path) -> None:
    """Issue 11 item 6: attempt 0 crashes at step 35 and is requeued; attempt 1 resumes and crashes at
    step 35 again: no third try. Crashing further on (step 40) is progress and is requeued."""
    from hpctrain.rundir.events import read_events

    task_dir = tmp_path / "run"
    task_dir.mkdir()
    script = render_script(_job(), run_dir=str(task_dir))
    _metrics_at(task_dir, 35)
    first = run_script(script, bin_dir=bin_dir, work=tmp_path / "a", env={"STUB_RANK_RC": "1"})
    assert first.returncode == 0 and ["requeue", "4242"] in first.argv_of("scontrol")
    again = run_script(script, bin_dir=bin_dir, work=tmp_path / "b", env={"STUB_RANK_RC": "1", "SLURM_RESTART_COUNT": "1"})
    assert again.returncode == 1 and not [a for a in again.argv_of("scontrol") if a[0] == "requeue"]
    assert b"not requeued: failed again at step 35 after a requeue" in again.stderr
    events = read_events(task_dir)
    assert [(e["event"], e["why_not"], e["step"]) for e in events] == [("requeued", "", 35),
                                                                       ("not_requeued", "same-step", 35)]
    from hpctrain.diagnose.doctor import diagnose_run

    titles = [f.title for f in diagnose_run(task_dir).findings]
    assert "failed again at step 35 after a requeue; not requeued" in titles, titles
    _metrics_at(task_dir, 40)
    later = run_script(script, bin_dir=bin_dir, work=tmp_path / "c", env={"STUB_RANK_RC": "1", "SLURM_RESTART_COUNT": "2"})
    assert later.returncode == 0 and ["requeue", "4242"] in later.argv_of("scontrol")


def test_requeue_disabled(tmp_path: Path, bin_dir: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = render_script(_job(requeue=False), run_dir=str(run_dir))
    assert "--no-requeue" in option_values(script) and "--requeue" not in option_values(script)
    run = run_script(script, bin_dir=bin_dir, work=tmp_path, env={"STUB_RANK_RC": "4"})
    assert run.returncode == 4 and not [a for a in run.argv_of("scontrol") if a[0] == "requeue"]
    assert b"not requeued: restart.requeue is false (rank-crashed)" in run.stderr


def test_stale_marker_from_an_earlier_attempt_is_ignored(tmp_path: Path, bin_dir: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "requeue-requested").write_text("from attempt 0\n")
    run = run_script(render_script(_job(), run_dir=str(run_dir)), bin_dir=bin_dir, work=tmp_path,
                     env={"SLURM_RESTART_COUNT": "1"})
    assert run.returncode == 0 and not [a for a in run.argv_of("scontrol") if a[0] == "requeue"]


def test_array_task_requeues_itself_only(tmp_path: Path, bin_dir: Path) -> None:
    run, task_dir = _run(tmp_path, bin_dir, array="0-3%2", STUB_RANK_RC="1",
                         SLURM_ARRAY_JOB_ID="4240", SLURM_ARRAY_TASK_ID="2")
    assert ["requeue", "4240_2"] in run.argv_of("scontrol")
    run_dir = tmp_path / "run"
    assert run.argv_of("python3") == [["-m", "hpctrain.runtime", f"--job={task_dir}/job.resolved.yaml",
                                       f"--run-dir={task_dir}"]]
    assert run.runtime_env["HPCTRAIN_REQUEUE_MARKER"] == f"{task_dir}/requeue-requested"
    assert _events(task_dir)[0]["job_id"] == "4240_2"
    options = option_values(render_script(_job(), run_dir=str(run_dir), array="0-3%2"))
    assert options["--array"] == "0-3%2"
    assert options["--output"] == f"{run_dir}/tasks/%a/slurm-%A_%a.out"


def test_ranks_get_the_signal_and_the_protocol_variables(tmp_path: Path, bin_dir: Path) -> None:
    script = render_script(_job(signal="USR2", signal_seconds=90), run_dir="/runs/x")
    options = option_values(script)
    assert options["--signal"] == "USR2@90"  # no B: prefix, so every task gets it
    assert options["--open-mode"] == "append" and "--requeue" in options
    run, _ = _run(tmp_path, bin_dir)
    env = run.runtime_env
    assert env["HPCTRAIN_REQUEUE_BY"] == "batch-script" and env["HPCTRAIN_ATTEMPT"] == "0"
    assert env["MASTER_ADDR"] == "10.0.0.1" and 20000 <= int(env["MASTER_PORT"]) < 32000  # node1's NodeAddr
    srun = run.argv_of("srun")[0]
    assert srun[:5] == ["--kill-on-bad-exit=1", "--nodes=2", "--ntasks-per-node=2", "--distribution=block:block",
                        "--cpus-per-task=8"]
    # every rank sees its node's GPUs (peer-to-peer kept) and picks LOCAL_RANK's; none bound per task
    assert "--cpu-bind=cores" in srun and "--gpus-per-node=2" in srun and "--gpus-per-task=1" not in srun


def test_master_addr_falls_back_to_the_node_name(tmp_path: Path, bin_dir: Path) -> None:
    """No NodeAddr from `scontrol show node` (here: the node is unknown): the host name is the address."""
    run, _ = _run(tmp_path, bin_dir, STUB_NODE_ADDR="")
    assert run.returncode == 0 and run.runtime_env["MASTER_ADDR"] == "node1"


@pytest.mark.parametrize("array", [None, "0-3%2"])
def test_each_rank_logs_to_its_own_file_per_attempt(tmp_path: Path, bin_dir: Path, array: str | None) -> None:
    """srun captures each task in logs/task-%t.attempt-A.log (stderr too) and tells the runtime where the
    rank's own log goes (HPCTRAIN_LOG_DIR): names that hpctrain.rundir.ranks and `hpctrain logs` read."""
    from hpctrain.launch.logs import parse_log_name
    from hpctrain.rundir.ranks import ATTEMPT_ENV, LOG_DIR_ENV, TASK_LOG

    run, task_dir = _run(tmp_path, bin_dir, array=array, SLURM_RESTART_COUNT="2", SLURM_ARRAY_JOB_ID="4240",
                         SLURM_ARRAY_TASK_ID="2")
    assert run.returncode == 0 and (task_dir / "logs").is_dir()
    [srun] = run.argv_of("srun")
    pattern = f"{task_dir}/logs/task-%t.attempt-2.log"
    assert f"--output={pattern}" in srun and f"--error={pattern}" in srun and "--open-mode=append" in srun
    assert TASK_LOG.match(pattern.rsplit("/", 1)[1].replace("%t", "3"))
    assert parse_log_name(pattern.rsplit("/", 1)[1].replace("%t", "3")) == (None, 2)  # not a rank's log
    assert run.runtime_env[LOG_DIR_ENV] == f"{task_dir}/logs" and run.runtime_env[ATTEMPT_ENV] == "2"


def test_cpu_jobs_bind_no_gpu(tmp_path: Path, bin_dir: Path) -> None:
    data = copy.deepcopy(BASE_JOB)
    data["monitor"] = {}
    data["cluster"]["gpu"] = "cpu"
    data["slurm"]["setup"] = []
    (tmp_path / "run").mkdir()
    run = run_script(render_script(job_from_dict(data), run_dir=str(tmp_path / "run")), bin_dir=bin_dir,
                     work=tmp_path)
    [srun] = run.argv_of("srun")
    assert run.returncode == 0 and not [a for a in srun if a.startswith("--gpu")]


def test_master_port_depends_on_job_and_attempt(tmp_path: Path, bin_dir: Path) -> None:
    ports = set()
    for job_id, attempt in (("4242", "0"), ("4242", "1"), ("4243", "0")):
        work = tmp_path / f"{job_id}-{attempt}"
        work.mkdir()
        (work / "run").mkdir()
        run = run_script(render_script(_job(), run_dir=str(work / "run")), bin_dir=bin_dir, work=work,
                         env={"SLURM_JOB_ID": job_id, "SLURM_RESTART_COUNT": attempt})
        ports.add(run.runtime_env["MASTER_PORT"])
    assert len(ports) == 3


def test_policy_runs_inside_the_image_when_there_is_one(tmp_path: Path, bin_dir: Path) -> None:
    """The restart policy needs hpctrain: with container.image it runs in the image, as the ranks do; the
    script acts on its answer on the host (scontrol)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    data = copy.deepcopy(BASE_JOB)
    data.update(monitor={}, container={"image": "/images/x.sif"})
    data["slurm"].update(setup=[])
    script = render_script(job_from_dict(data), run_dir=str(run_dir))
    [line] = [line for line in script.splitlines() if "-m hpctrain.rundir.restart --run-dir" in line]
    assert line.startswith(f"singularity exec --bind={run_dir} -- /images/x.sif python3 -m hpctrain.rundir.restart")
    run = run_script(script, bin_dir=bin_dir, work=tmp_path, env={"STUB_RANK_RC": "3"})
    assert run.returncode == 0 and ["requeue", "4242"] in run.argv_of("scontrol")
    assert [(e["event"], e["reason"]) for e in _events(run_dir)] == [("requeued", "rank-crashed")]


@pytest.mark.parametrize(("env", "status", "events"), [
    ({}, 0, []),  # the run finished: done, whatever the policy
    ({"STUB_RANK_RC": "3"}, 3, [("not_requeued", "rank-crashed", "policy-failed")]),
])
def test_policy_that_cannot_run_is_reported(tmp_path: Path, bin_dir: Path, env: dict[str, str], status: int,
                                            events: list[tuple[str, str, str]]) -> None:
    run, task_dir = _run(tmp_path, bin_dir, STUB_REAL_PYTHON="/bin/false", **env)  # no hpctrain where it runs
    assert run.returncode == status
    assert not [a for a in run.argv_of("scontrol") if a[0] == "requeue"]
    assert [(e["event"], e["reason"], e["why_not"]) for e in _events(task_dir)] == events
    if events:
        assert b"not requeued: the restart policy did not answer (python3 -m hpctrain.rundir.restart exited 1)" \
            in run.stderr


def test_a_resumed_job_continues_the_run_directorys_attempt_count(tmp_path: Path, bin_dir: Path) -> None:
    """Issue 29: `hpctrain resume` submits a new job, whose SLURM_RESTART_COUNT starts at 0 again; the run's
    attempt goes on from its logs (attempt 3 after attempts 0-2), while restart.max_requeues counts this
    job's own requeues (here none, so a crash is requeued although 3 attempts are behind it)."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    for name in ("task-0.attempt-0.log", "rank-0.attempt-1.log", "rank-1.attempt-2.log", "notes.log"):
        (run_dir / "logs" / name).write_text("earlier\n")
    script = render_script(_job(), run_dir=str(run_dir))
    run = run_script(script, bin_dir=bin_dir, work=tmp_path, env={"STUB_RANK_RC": "1", "SLURM_RESTART_COUNT": "0"})
    assert run.runtime_env["HPCTRAIN_ATTEMPT"] == "3"
    [srun] = run.argv_of("srun")
    assert f"--output={run_dir}/logs/task-%t.attempt-3.log" in srun
    assert b"attempt 3" in run.stdout
    [requeued] = [e for e in _events(run_dir) if e["event"] == "requeued"]
    assert (requeued["attempt"], requeued["reason"]) == (3, "rank-crashed")
    assert ["requeue", "4242"] in run.argv_of("scontrol")
