"""Pure parts of the launcher: grid expansion, run directory names and lookup, events, log names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpctrain.errors import ConfigError
from hpctrain.launch import rundir
from hpctrain.launch.logs import parse_log_name
from hpctrain.launch.status import restarts_from_events
from hpctrain.launch.sweep import expand_grid, parse_grid_option


@pytest.mark.parametrize("text, key, values", [
    ("parallel.tp=1,2,4", "parallel.tp", [1, 2, 4]),
    ("train.optimizer.lr=3e-4,1e-3", "train.optimizer.lr", [3e-4, 1e-3]),
    ("train.activation_checkpointing=none,full", "train.activation_checkpointing", ["none", "full"]),
    ("parallel.tp=[1, 2]", "parallel.tp", [1, 2]),
    ("parallel.sequence_parallel=true,false", "parallel.sequence_parallel", [True, False]),
    ("parallel.tp=auto", "parallel.tp", ["auto"]),
])
def test_parse_grid_option(text: str, key: str, values: list[object]) -> None:
    assert parse_grid_option(text) == (key, values)


@pytest.mark.parametrize("text", ["parallel.tp", "parallel.tp=1,,2", "=1,2", "parallel.tp="])
def test_parse_grid_option_rejects(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_grid_option(text)
    assert info.value.exit_code == 2


def test_expand_grid_last_key_fastest() -> None:
    assert expand_grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]


@pytest.mark.parametrize("name, slug", [
    ("quickstart", "quickstart"),
    ("My job (v2)!", "my-job-v2"),
    ("$(rm -rf /); echo", "rm-rf-echo"),
    ("../../etc", "etc"),
    ("日本語", "job"),
    ("x" * 100, "x" * 48),
])
def test_slugify(name: str, slug: str) -> None:
    assert rundir.slugify(name) == slug


def test_create_run_dir_is_unique_and_laid_out(tmp_path: Path) -> None:
    first = rundir.create_run_dir(tmp_path / "runs", "Demo job", now=0)
    second = rundir.create_run_dir(tmp_path / "runs", "Demo job", now=0)
    assert first != second and second.name == first.name + "-2"
    assert first.name.startswith("demo-job-") and (first / "submit").is_dir() and (first / "logs").is_dir()


def test_events_and_find_run(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = rundir.create_run_dir(runs, "alpha", now=0)
    rundir.append_event(run, "submitted", executor="slurm", job_id="7")
    with open(run / rundir.EVENTS, "a") as handle:
        handle.write('{"torn": ')  # a half-written line is skipped
    assert rundir.last_submission(run)["job_id"] == "7"
    assert rundir.find_run("alpha", str(runs)) == run
    assert rundir.find_run(str(run)) == run
    with pytest.raises(ConfigError, match="no run directory 'beta'.*alpha"):
        rundir.find_run("beta", str(runs))


@pytest.mark.parametrize("name, rank, attempt", [
    ("rank-3.attempt-1.log", 3, 1),
    ("rank-0.attempt-0.log", 0, 0),
    ("slurm-12.out", None, 0),
    ("rank_12-attempt_2.out", 12, 2),
])
def test_parse_log_name(name: str, rank: int | None, attempt: int) -> None:
    assert parse_log_name(name) == (rank, attempt)


@pytest.mark.parametrize("events, restarts", [
    ([], 0),
    ([{"event": "submitted"}, {"event": "started", "attempt": 0}], 0),
    ([{"event": "submitted"}, {"event": "started", "attempt": 0}, {"event": "requeued"},
      {"event": "started", "attempt": 1}, {"event": "started", "attempt": 2}], 2),
    # only the current submission counts: a resumed run starts again at 0
    ([{"event": "submitted"}, {"event": "started", "attempt": 0}, {"event": "started", "attempt": 1},
      {"event": "submitted"}, {"event": "started", "attempt": 0}], 0),
])
def test_restarts_from_events(events: list[dict[str, object]], restarts: int) -> None:
    assert restarts_from_events(json.loads(json.dumps(events))) == restarts


def test_login_path_never_imports_torch(tmp_path: Path) -> None:
    """submit --dry-run and status run the whole login path (config, plan, render, launch) without torch."""
    import subprocess
    import sys

    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: tiny}\ntrain: {micro_batch: 1, precision: fp32, "
                   "activation_checkpointing: none}\nparallel: {tp: 1, pp: 1}\n"
                   "cluster: {executor: slurm, nodes: 1, gpus_per_node: 1, gpu: a100-80gb}\n")
    code = ("import sys; from hpctrain import cli; "
            "assert cli.main(['submit', sys.argv[1], '--dry-run']) == 0; "
            "assert cli.main(['status', 't', '--json']) == 0; "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    bin_dir = tmp_path / "bin"  # a stand-in sbatch: the dry run never calls it
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}", "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code, str(job)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert '"state": "DRY_RUN"' in result.stdout


def test_find_run_matches_whole_names_only(tmp_path) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.launch.rundir import find_run

    (tmp_path / "tiny-20261130-101010").mkdir()
    (tmp_path / "t-20261130-101011").mkdir()
    assert find_run("tiny", str(tmp_path)).name == "tiny-20261130-101010"
    assert find_run("t", str(tmp_path)).name == "t-20261130-101011"
    with pytest.raises(ConfigError, match="no run directory"):
        find_run("ti", str(tmp_path))
