"""A job submitted from an interpreter that is not on PATH (a venv never activated) trains on the real
test Slurm: the batch script runs the ranks with the interpreter hpctrain was submitted from."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from ._helpers import log_tail, run_cli, run_dir_of, status_json, tiny_job, write_job


@pytest.mark.slurm
def test_slurm_job_trains_with_the_submitting_interpreter_off_path(slurm_cluster: Any, tmp_path: Path) -> None:
    env = slurm_cluster.client_env()
    interpreter_bin = os.path.dirname(sys.executable)
    # A python3 first on PATH that cannot train: the job would die with exit 97 if the script ran it.
    decoy = tmp_path / "decoy-bin"
    decoy.mkdir()
    (decoy / "python3").write_text("#!/bin/sh\necho 'decoy python3 from PATH' >&2\nexit 97\n")
    (decoy / "python3").chmod(0o755)
    kept = [d for d in env["PATH"].split(os.pathsep) if d and os.path.realpath(d) != os.path.realpath(interpreter_bin)]
    env["PATH"] = os.pathsep.join([str(decoy), *kept])
    job = write_job(tmp_path, tiny_job("offpath", executor="slurm", steps=2))
    result = run_cli(["submit", str(job), "--wait", "--timeout", "150"], cwd=tmp_path, env=env, timeout_s=180)
    run_dir = run_dir_of(result)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{log_tail(run_dir)}"
    status = status_json(run_dir, env)
    assert (status["state"], status["step"]) == ("COMPLETED", 2), log_tail(run_dir)
    script = (run_dir / "submit" / "job.sbatch").read_text()
    assert f"{shlex.quote(sys.executable)} -m hpctrain.runtime" in script


def test_local_ranks_run_runtime_python(tmp_path: Path) -> None:
    """executor local: each rank runs runtime.python too (here a wrapper that leaves a mark, then runs
    the real interpreter)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    wrapper = tmp_path / "my python"
    wrapper.write_text(f'#!/bin/sh\n: > "{marks}/$$"\nexec {shlex.quote(sys.executable)} "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    job = write_job(tmp_path, tiny_job("wrapped", executor="local", gpus_per_node=2, steps=1,
                                       runtime={"python": str(wrapper)}))
    result = run_cli(["submit", str(job), "--wait", "--timeout", "120"], cwd=tmp_path, env=env, timeout_s=150)
    run_dir = run_dir_of(result)
    assert result.returncode == 0, f"{result.stderr}\n{log_tail(run_dir)}"
    assert status_json(run_dir, env)["state"] == "COMPLETED", log_tail(run_dir)
    assert len(list(marks.iterdir())) == 2  # both ranks started through runtime.python
