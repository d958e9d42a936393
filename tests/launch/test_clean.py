"""`hpctrain clean --dry-runs` (issue 29: dry runs piled up in `status` with no way to clean them): it removes
the run directories that only a dry run wrote, and nothing that ever ran, was submitted or is not a run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpctrain.cli import main


def _event(run: Path, **record: object) -> None:
    with open(run / "events.jsonl", "a") as handle:
        handle.write(json.dumps({"time": "2026-01-01T00:00:00+00:00", **record}) + "\n")


def test_clean_removes_only_dry_runs_that_never_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: tiny}\ntrain: {micro_batch: 1, precision: fp32, steps: 2, "
                   "activation_checkpointing: none}\nparallel: {tp: 1, pp: 1}\n"
                   "cluster: {executor: local, nodes: 1, gpus_per_node: 1, gpu: a100-80gb}\n")
    assert main(["submit", str(job), "--dry-run"]) == 0
    assert main(["sweep", str(job), "--grid", "train.micro_batch=1,2", "--dry-run"]) == 0
    runs = tmp_path / "runs"
    dry = sorted(runs.iterdir())
    assert len(dry) == 2
    kept = []
    ran = runs / "ran-20260101-000000"  # submitted, and it logged steps
    ran.mkdir()
    _event(ran, event="dry_run", executor="local")
    _event(ran, event="submitted", executor="local", job_id="local-1")
    (ran / "metrics.jsonl").write_text('{"step": 1}\n')
    kept.append(ran)
    resumed = runs / "resumed-20260101-000000"  # a resume's dry run in a run that was submitted
    resumed.mkdir()
    _event(resumed, event="submitted", executor="local", job_id="local-2")
    _event(resumed, event="dry_run", executor="local")
    kept.append(resumed)
    logged = runs / "logged-20260101-000000"  # only a dry_run event, but a rank wrote a log
    (logged / "logs").mkdir(parents=True)
    _event(logged, event="dry_run")
    (logged / "logs" / "rank-0.attempt-0.log").write_text("step 1\n")
    kept.append(logged)
    other = runs / "notes"  # not a run directory
    other.mkdir()
    (other / "todo.txt").write_text("keep me\n")
    kept.append(other)
    outside = tmp_path / "elsewhere-20260101-000000"  # a dry run outside runs/, reached through a link
    outside.mkdir()
    _event(outside, event="dry_run")
    os.symlink(outside, runs / "link-20260101-000000")
    kept.append(runs / "link-20260101-000000")
    capsys.readouterr()

    assert main(["clean", "--dry-runs"]) == 0  # without --yes: only the list
    assert capsys.readouterr().out.splitlines() == [f"would remove {Path('runs', p.name)}" for p in dry] + [
        "2 dry run(s); rerun with --yes to remove them"]
    assert all(p.exists() for p in dry)
    assert main(["clean", "--dry-runs", "--yes"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"removed {Path('runs', p.name)}" for p in dry]
    assert sorted(runs.iterdir()) == sorted(kept) and outside.is_dir()
    assert main(["clean", "--dry-runs"]) == 0
    assert capsys.readouterr().out == "no dry runs in runs/\n"
