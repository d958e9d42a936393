"""The rendered script on the real local Slurm (tests/slurm_cluster.py): what sbatch itself reads from
our #SBATCH lines, and the exit path requeueing a job whose rank crashed.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.render import render_script
from hpctrain.render.quoting import slurm_job_name

from .hostile import BASE_JOB, HOSTILE, sbatch_safe
from .sbatch_parser import option_values

pytestmark = pytest.mark.slurm

# What sbatch accepts as a comment: no control characters (refused by render) and not kilobytes long.
COMMENTS = [v for v in HOSTILE if sbatch_safe(v) and len(v) < 1000]


def _job(name: str, **slurm: Any) -> Any:
    data = copy.deepcopy(BASE_JOB)
    data.update(name=name, monitor={})
    data["cluster"].update(gpu="cpu", nodes=2, gpus_per_node=2)
    data["slurm"].update(setup=[], time="00:05:00", **slurm)
    return job_from_dict(data)


def test_sbatch_reads_our_directives_byte_for_byte(slurm_cluster: Any, tmp_path: Path) -> None:
    """Each hostile string as --comment and as the job name: Slurm stores exactly what our parser model says."""
    jobs = []
    try:
        for value in COMMENTS:
            script = render_script(_job(value, extra={"comment": value}), run_dir=str(tmp_path / "r"))
            assert option_values(script)["--comment"] == value
            jobs.append((value, slurm_cluster.sbatch("--hold", script=script)))
        for value, jobid in jobs:
            out = slurm_cluster.run(["squeue", "-h", "-j", jobid, "-o", "%k\x1f%j"]).stdout
            comment, name = out.rstrip("\n").split("\x1f")
            assert comment == value and name == slurm_job_name(value)
    finally:
        if jobs:
            slurm_cluster.run(["scancel", *[jobid for _, jobid in jobs]], check=False)


RANK = """#!/bin/bash
# Stands in for `python3 -m hpctrain.runtime`: rank 1 crashes on the first attempt only. The exit path's
# restart policy (`python3 -m hpctrain.rundir.restart`) is hpctrain's own: the real interpreter runs it.
if [ "${1:-} ${2:-}" = "-m hpctrain.rundir.restart" ]; then exec "$STUB_REAL_PYTHON" "$@"; fi
printf '%s %s %s\\n' "$SLURM_PROCID" "${SLURM_RESTART_COUNT:-0}" "$*" >> "$RANK_LOG"
if [ "${SLURM_RESTART_COUNT:-0}" = 0 ] && [ "$SLURM_PROCID" = 1 ]; then exit 3; fi
"""


def test_crashed_rank_is_requeued_by_the_script_and_resumes(slurm_cluster: Any, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(RANK)
    (bin_dir / "python3").chmod(0o755 | stat.S_IXUSR)
    run_dir = tmp_path / "run dir 100% $(pwned)"
    run_dir.mkdir()
    script = render_script(_job("crash 'n' requeue", max_requeues=2), run_dir=str(run_dir))
    env = dict(slurm_cluster.client_env(), PATH=f"{bin_dir}:{slurm_cluster.env['PATH']}",
               RANK_LOG=str(tmp_path / "ranks.txt"), STUB_REAL_PYTHON=sys.executable)
    submitted = subprocess.run(["sbatch", "--parsable"], input=script, env=env, capture_output=True, text=True,
                               timeout=30, check=True)
    jobid = submitted.stdout.strip()
    try:
        state = slurm_cluster.wait_job(jobid, "COMPLETED", timeout_s=120)
    finally:
        slurm_cluster.run(["scancel", jobid], check=False)
    output = (run_dir / f"slurm-{jobid}.out").read_text()
    assert state == "COMPLETED", output
    info = slurm_cluster.job_info(jobid) or {}
    assert info.get("Restarts") == "1", info
    assert "attempt 0" in output and "attempt 1" in output  # --open-mode=append kept both attempts
    assert "srun exited with status 3" in output and "requeueing" in output
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["reason"], e["attempt"]) for e in events] == [("requeued", "rank-crashed", 0)]
    ranks = (tmp_path / "ranks.txt").read_text().splitlines()
    second = sorted(line for line in ranks if line.split()[1] == "1")
    args = f"-m hpctrain.runtime --job={run_dir}/job.resolved.yaml --run-dir={run_dir}"
    assert second == [f"{rank} 1 {args}" for rank in range(4)]
    assert not os.path.exists(tmp_path / "PWNED")
