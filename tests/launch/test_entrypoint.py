"""Issue 28: your own training script (`entrypoint:`) on the local executor, for real.

Real runs (`hpctrain submit ... --wait`, 2 local ranks, gloo): an unmodified torchrun-style script that
never imports hpctrain; the example script (examples/own-script) stopped by the requeue signal mid-run and
continued from its own checkpoint with every step once; a script that exits 2; `plan`'s degrees in the
script's environment. Plus the config rules and the API's import weight, which need no run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpctrain.config import job_from_dict
from hpctrain.errors import ConfigError

from tests.launch._helpers import REPO, log_tail, run_cli, run_dir_of, status_json, write_job

EXAMPLE = REPO / "examples" / "own-script"

# A torchrun-style script that knows nothing of hpctrain: torchrun's variables, gloo, DDP, a few steps.
PLAIN_SCRIPT = '''
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(rank)
for step in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
weights = [p.detach().clone() for p in model.parameters()]
gathered = [None] * world
dist.all_gather_object(gathered, [w.tolist() for w in weights])
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "HPCTRAIN_RUN_DIR",
        "HPCTRAIN_CHECKPOINT_DIR", "HPCTRAIN_ATTEMPT", "HPCTRAIN_TP", "HPCTRAIN_PP", "HPCTRAIN_DP")
out = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "same_weights": all(g == gathered[0] for g in gathered),
       "hpctrain_imported": any(m == "hpctrain" or m.startswith("hpctrain.") for m in sys.modules)}
with open(os.path.join(sys.argv[1], "rank-%d.json" % rank), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
'''


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=os.path.dirname(sys.executable), OMP_NUM_THREADS="1")
    return env


def _job(name: str, entrypoint: dict[str, Any], **sections: Any) -> dict[str, Any]:
    job: dict[str, Any] = {"name": name, "entrypoint": entrypoint,
                           "cluster": {"executor": "local", "gpu": "cpu", "nodes": 1, "gpus_per_node": 2}}
    job.update(sections)
    return job


# -- config: no run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("entrypoint, wanted", [
    ({"script": "t.py", "args": ["--x", "{nope}"]}, "entrypoint.args[1]: unknown placeholder {nope}"),
    ({"script": "t.py", "module": "pkg.t"}, "entrypoint: needs exactly one of script and module"),
    ({"args": ["a"]}, "entrypoint: needs exactly one of script and module"),
    ({"script": "t.py", "args": ["{tp"]}, "entrypoint.args[0]: has an unmatched brace"),
])
def test_entrypoint_problems_are_one_line_each(entrypoint: dict[str, Any], wanted: str) -> None:
    with pytest.raises(ConfigError) as info:
        job_from_dict(_job("bad", entrypoint))
    assert len(info.value.problems) == 1 and wanted in info.value.problems[0], info.value.problems


def test_model_is_optional_only_with_an_entrypoint(tmp_path: Path) -> None:
    job = job_from_dict(_job("ok", {"module": "pkg.train", "args": ["--tp={tp}", "{{literal}}"]}))
    assert job.model is None and job.entrypoint is not None
    bad = write_job(tmp_path, {"name": "nothing", "cluster": {"gpu": "cpu"}})
    result = run_cli(["validate", str(bad)], cwd=tmp_path, env=_env(), timeout_s=60)
    assert result.returncode == 2 and "model: is required unless entrypoint is given" in result.stderr, result
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_script_path_is_relative_to_the_job_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = write_job(tmp_path / "sub", _job("rel", {"script": "train.py"}))
    from hpctrain.config import load_job

    assert load_job(str(path)).entrypoint.script == str(tmp_path / "sub" / "train.py")  # type: ignore[union-attr]


def test_the_api_imports_neither_torch_nor_pydantic() -> None:
    code = ("import sys, hpctrain.job as j; j.should_stop(); j.log(0, loss=1.0); "
            "print(sorted(m for m in ('torch', 'pydantic') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**_env(), "HPCTRAIN_RUN_DIR": ""})
    assert out.stdout.strip() == "[]", out


# -- real local runs -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_unmodified_torchrun_script_trains_on_two_ranks_with_the_planned_degrees(tmp_path: Path) -> None:
    """No hpctrain import in the script; with model: given, `plan` chooses the layout and its degrees reach
    the script (HPCTRAIN_TP/PP/DP and the {tp} {pp} {dp} placeholders)."""
    (tmp_path / "plain.py").write_text(PLAIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    job = _job("plain", {"script": "plain.py", "args": [str(out), "tp={tp}", "pp={pp}", "dp={dp}", "w={world_size}"]},
               model={"preset": "tiny"}, train={"global_batch": 8})
    job["cluster"]["gpu"] = "a100-80gb"  # a catalogued GPU for the planner; the ranks run on CPU (gloo)
    path = write_job(tmp_path, job)
    env = _env()
    plan = run_cli(["plan", str(path), "--json"], cwd=tmp_path, env=env, timeout_s=120)
    assert plan.returncode == 0, plan.stderr
    best = json.loads(plan.stdout)["layouts"][0]
    result = run_cli(["submit", str(path), "--wait", "--timeout", "150"], cwd=tmp_path, env=env, timeout_s=200)
    run_dir = run_dir_of(result)
    assert result.returncode == 0, result.stdout + result.stderr + log_tail(run_dir)
    resolved = yaml.safe_load((run_dir / "job.resolved.yaml").read_text())["parallel"]
    assert (resolved["tp"], resolved["pp"], resolved["dp"]) == (best["tp"], best["pp"], best["dp"])
    records = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    for rank, record in enumerate(records):
        env_seen = record["env"]
        assert (env_seen["RANK"], env_seen["WORLD_SIZE"], env_seen["LOCAL_WORLD_SIZE"]) == (str(rank), "2", "2")
        assert env_seen["MASTER_ADDR"] == "127.0.0.1" and env_seen["MASTER_PORT"]
        assert env_seen["HPCTRAIN_RUN_DIR"] == str(run_dir) and env_seen["HPCTRAIN_ATTEMPT"] == "0"
        assert env_seen["HPCTRAIN_CHECKPOINT_DIR"] == str(run_dir / "checkpoints")
        assert (env_seen["HPCTRAIN_TP"], env_seen["HPCTRAIN_PP"], env_seen["HPCTRAIN_DP"]) == tuple(
            str(best[k]) for k in ("tp", "pp", "dp"))
        assert record["argv"][1:] == [f"tp={best['tp']}", f"pp={best['pp']}", f"dp={best['dp']}", "w=2"]
        assert record["same_weights"] and not record["hpctrain_imported"]
    status = status_json(run_dir, env)
    assert status["state"] == "COMPLETED", status
    assert status["steps"] is None  # train.steps is not the program's: no made-up total
    assert sorted(p.name for p in (run_dir / "logs").glob("rank-*.log")) == ["rank-0.attempt-0.log",
                                                                              "rank-1.attempt-0.log"]


def _entry_pids(run_dir: Path) -> list[int]:
    """The rank wrappers of this run (python -m hpctrain.launch.entrypoint ... --run-dir RUN)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "hpctrain.launch.entrypoint" in argv and str(run_dir) in argv:
            pids.append(int(proc.name))
    return pids


def _wait_for_step(run_dir: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached in {timeout_s} s:\n{log_tail(run_dir)}")


@pytest.mark.slow
def test_example_stops_on_the_signal_and_resumes_from_its_own_checkpoint(tmp_path: Path) -> None:
    """The local executor has no requeue (nothing requeues a local run, launch/local/supervisor.py): the
    signal ends the attempt STOPPED after the script saved, and `hpctrain resume` continues it. The Slurm
    path, where the exit path requeues, is tests/launch/test_entrypoint_slurm.py."""
    job = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["entrypoint"].update(script=str(EXAMPLE / "train.py"),
                             args=["--steps", "12", "--save-every", "100", "--step-delay", "0.3"])
    job["restart"]["grace_s"] = 30
    path = write_job(tmp_path, job)
    env = _env()
    first = subprocess.Popen([sys.executable, "-m", "hpctrain", "submit", str(path), "--wait", "--timeout", "150"],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    runs = tmp_path / "runs"
    while time.monotonic() < deadline and not (runs.exists() and list(runs.iterdir())):
        time.sleep(0.2)
    [run_dir] = list(runs.iterdir())
    _wait_for_step(run_dir, 3, 90)
    pids = _entry_pids(run_dir)
    assert len(pids) == 2, pids
    for pid in pids:  # what sbatch --signal does: restart.signal to every rank
        os.kill(pid, signal.SIGUSR2)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 1, out + err + log_tail(run_dir)
    status = status_json(run_dir, env)
    assert status["state"] == "STOPPED" and "signal USR2; stopped at step" in (status["reason"] or ""), status
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    assert len(saved) == 1, saved
    stopped_at = int(saved[0].split("-")[1].split(".")[0])
    assert 3 <= stopped_at < 11, saved

    second = run_cli(["resume", str(run_dir), "--wait", "--timeout", "150"], cwd=tmp_path, env=env, timeout_s=200)
    assert second.returncode == 0, second.stdout + second.stderr + log_tail(run_dir)
    assert status_json(run_dir, env)["state"] == "COMPLETED"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(12)), lines  # every step once
    assert {m["attempt"] for m in lines if m["step"] <= stopped_at} == {0}
    assert {m["attempt"] for m in lines if m["step"] > stopped_at} == {1}
    resumed = (run_dir / "logs" / "rank-0.attempt-1.log").read_text()
    assert f"resumed from {run_dir / 'checkpoints' / saved[0]} (attempt 1)" in resumed, resumed


@pytest.mark.slow
def test_a_script_that_exits_2_fails_with_the_reason_in_status(tmp_path: Path) -> None:
    (tmp_path / "refuse.py").write_text("import sys\nprint('refusing my input', flush=True)\nsys.exit(2)\n")
    path = write_job(tmp_path, _job("refuse", {"script": "refuse.py"}))
    env = _env()
    result = run_cli(["submit", str(path), "--wait", "--timeout", "90"], cwd=tmp_path, env=env, timeout_s=150)
    run_dir = run_dir_of(result)
    assert result.returncode == 1, result.stdout + result.stderr
    status = status_json(run_dir, env)
    assert status["state"] == "FAILED" and "exited with code 2" in status["reason"], status
    # The first rank to exit 2 stops the rank group (TERM to the others, which may not have printed yet under
    # load): the log of the rank the status names holds the program's output.
    refusing = re.search(r"rank (\d+) exited with code 2", status["reason"])
    assert refusing, status
    assert "refusing my input" in (run_dir / "logs" / f"rank-{refusing.group(1)}.attempt-0.log").read_text()
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "failed" and e.get("reason") == "the program exited 2 (bad input)" for e in events)


def test_a_missing_script_is_bad_input_on_the_rank(tmp_path: Path) -> None:
    """The wrapper itself, without a launcher: exit 2, one line naming the field, the bad-input marker."""
    from hpctrain.config import dump_job

    job = job_from_dict(_job("missing", {"script": str(tmp_path / "nope.py")}))
    (tmp_path / "job.resolved.yaml").write_text(dump_job(job))
    marker = tmp_path / "bad-input"
    result = subprocess.run([sys.executable, "-m", "hpctrain.launch.entrypoint", "--job",
                             str(tmp_path / "job.resolved.yaml"), "--run-dir", str(tmp_path)],
                            env={**_env(), "HPCTRAIN_BAD_INPUT_MARKER": str(marker)}, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and f"entrypoint.script {tmp_path / 'nope.py'}: no such file" in result.stderr
    assert "Traceback" not in result.stderr and "no such file" in marker.read_text()


@pytest.mark.parametrize("given, wanted", [({}, (1, 1, 4)), ({"tp": 2}, (2, 1, 2)), ({"dp": 1}, (4, 1, 1)),
                                           ({"tp": 2, "dp": 1}, (2, 2, 1)), ({"tp": 1, "pp": 2, "dp": 2}, (1, 2, 2))])
def test_degrees_without_a_model_fill_the_gpus(given: dict[str, int], wanted: tuple[int, int, int]) -> None:
    """No model, nothing planned: a sweep over parallel.* gives the script degrees that multiply to the GPUs."""
    from hpctrain.config.entrypoint import layout_without_model

    job = _job("degrees", {"script": "t.py", "args": ["{tp}"]}, parallel=given)
    job["cluster"]["gpus_per_node"] = 4
    p = layout_without_model(job_from_dict(job)).parallel
    assert (p.tp, p.pp, p.dp) == wanted


def test_the_exit_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch/entrypoint.py's one rule: exit 0 after the signal = saved, requeue me (the requeue marker where
    something requeues, else a `stopped` run and exit 1 on rank 0); exit 0 without it = finished; exit 2 = bad
    input (its marker); anything else, a signal's death included, is a crash with its code."""
    from hpctrain.launch.entrypoint import Rank

    job = job_from_dict(_job("rule", {"script": "t.py"}))
    marker, bad = tmp_path / "requeue-requested", tmp_path / "bad-input"
    monkeypatch.setenv("HPCTRAIN_REQUEUE_MARKER", str(marker))
    monkeypatch.setenv("HPCTRAIN_BAD_INPUT_MARKER", str(bad))

    def outcome(code: int, signalled: str | None, requeue_by: str | None = "batch-script", rank: int = 0) -> int:
        if requeue_by:
            monkeypatch.setenv("HPCTRAIN_REQUEUE_BY", requeue_by)
        else:
            monkeypatch.delenv("HPCTRAIN_REQUEUE_BY", raising=False)
        r = Rank(job, tmp_path, rank, attempt=0)
        r.signalled = signalled
        return r.outcome(code)

    assert outcome(0, None) == 0 and not marker.exists()
    assert outcome(0, "USR2") == 0
    assert marker.read_text() == "signal USR2; the program exited 0 after SIGTERM (saved)\n"
    marker.unlink()
    assert outcome(0, "USR2", rank=1) == 0 and not marker.exists()  # rank 0 alone writes it
    assert outcome(0, "TERM", requeue_by=None) == 1 and outcome(0, "TERM", requeue_by=None, rank=1) == 0
    assert outcome(2, "USR2") == 2 and "rank 0: the program exited 2 (bad input)" in bad.read_text()
    assert outcome(3, None) == 3 and outcome(-9, "USR2") == 137
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["finished", "requeue requested", "stopped", "failed", "failed", "failed"]


def test_should_stop_ignores_a_stale_stop_file(tmp_path: Path) -> None:
    """The stop file names its attempt: a requeued attempt does not stop on its predecessor's request."""
    stop = tmp_path / "stop-requested"
    stop.write_text("0\n")
    code = "import hpctrain.job as j; print(j.should_stop(), j.attempt(), j.checkpoint_dir())"
    for attempt, wanted in (("0", "True 0"), ("1", "False 1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                             env={**_env(), "HPCTRAIN_STOP_FILE": str(stop), "HPCTRAIN_ATTEMPT": attempt,
                                  "HPCTRAIN_RUN_DIR": str(tmp_path)})
        assert out.stdout.strip() == f"{wanted} {tmp_path / 'checkpoints'}", out


def test_plan_without_a_model_says_what_the_script_gets(tmp_path: Path) -> None:
    path = write_job(tmp_path, _job("noplan", {"script": "t.py"}, parallel={"tp": 2}))
    result = run_cli(["plan", str(path)], cwd=tmp_path, env=_env(), timeout_s=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("no model: nothing to plan; the entrypoint runs with tp=2 pp=1 dp=1 (give "
                                     "model: to have the layout advised)")


def test_a_volcano_pod_runs_the_wrapper_for_an_entrypoint_job(tmp_path: Path) -> None:
    from hpctrain.config import dump_job
    from hpctrain.launch.volcano.pod import rank_module_of

    own = tmp_path / "own.yaml"
    own.write_text(dump_job(job_from_dict(_job("pod", {"script": "t.py"}))))
    builtin = tmp_path / "builtin.yaml"
    builtin.write_text(yaml.safe_dump({"name": "b", "model": {"preset": "tiny"}}))
    assert rank_module_of(own) == "hpctrain.launch.entrypoint"
    assert rank_module_of(builtin) == rank_module_of(tmp_path / "missing.yaml") == "hpctrain.runtime"
