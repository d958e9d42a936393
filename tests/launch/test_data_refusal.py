"""`submit` and `sweep` refuse a job whose token file does not fit it (vocab, dtype, missing file)
before creating or submitting anything: exit 2, one line per problem."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hpctrain.data.prepare import prepare

from ._helpers import REPO, run_cli, write_job


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """Byte-level tokens (vocab 256, uint16) of this repository's README."""
    out = str(tmp_path_factory.mktemp("tok") / "tokens.bin")
    prepare([str(REPO / "README.md")], out)
    return out


@pytest.fixture()
def fake_sbatch(tmp_path) -> tuple[dict[str, str], Path]:
    """An `sbatch` on PATH that only records being called: the point is to show it is never called, which
    a real Slurm cannot show more directly (no job id to look for)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "sbatch-called"
    script = bin_dir / "sbatch"
    script.write_text(f"#!/bin/sh\ntouch '{marker}'\necho 'Submitted batch job 1'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return env, marker


@pytest.mark.parametrize("command", ["submit", "sweep"])
def test_submit_and_sweep_refuse_before_submitting(tokens, tmp_path, fake_sbatch, command) -> None:
    env, marker = fake_sbatch
    job = {"name": "bad-data", "model": {"preset": "tiny", "vocab": 128},
           "train": {"global_batch": 8, "steps": 3, "data": tokens, "precision": "fp32"},
           "parallel": {"tp": 1, "pp": 1}, "cluster": {"executor": "slurm", "nodes": 1, "gpus_per_node": 1},
           "slurm": {"time": "00:10:00"}, "runs_dir": str(tmp_path / "runs")}
    if command == "sweep":
        job["sweep"] = {"grid": {"train.seed": [1, 2]}}
    result = run_cli([command, str(write_job(tmp_path, job))], cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == (1 if command == "submit" else 2), result.stderr  # sweep: one line per point
    assert all("model.vocab: got 128 but" in line for line in lines)
    assert not marker.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("key, value", [("vocab", -1), ("tokens", 2**70), ("eos_id", "0")])
def test_sidecar_numbers_are_bounded(tokens, tmp_path, capsys, key, value) -> None:
    """Issue 30 Why 9: a sidecar's `vocab: -1` was accepted; its numbers meet the schema's bounds now."""
    import json
    import shutil

    from hpctrain.cli.main import main

    data = tmp_path / "tokens.bin"
    shutil.copy(tokens, data)
    side = json.loads(Path(tokens + ".json").read_text())
    (tmp_path / "tokens.bin.json").write_text(json.dumps({**side, key: value}))
    job = {"name": "side", "model": {"preset": "tiny"}, "train": {"global_batch": 8, "steps": 3, "data": str(data)},
           "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 1}, "runs_dir": str(tmp_path / "runs")}
    code = main(["submit", "--dry-run", str(write_job(tmp_path, job))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert f"tokens.bin.json has {key} {value!r}; expected a whole number from" in lines[0]
    assert not (tmp_path / "runs").exists()


def test_an_empty_token_file_is_refused_before_any_rank_starts(tmp_path, capsys) -> None:
    """Issue 30 Why 9: an empty token file reached the ranks, where a peer's DistNetworkError could be what
    the run reported; the login node (and the runtime's check before any process group) refuses it now."""
    from hpctrain.cli.main import main

    (tmp_path / "empty.bin").write_bytes(b"")
    job = {"name": "empty", "model": {"preset": "tiny"},
           "train": {"global_batch": 8, "steps": 3, "data": str(tmp_path / "empty.bin")},
           "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 2}, "runs_dir": str(tmp_path / "runs")}
    code = main(["submit", "--dry-run", str(write_job(tmp_path, job))])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines == [f"train.data: {tmp_path / 'empty.bin'} holds 0 tokens, fewer than seq_len + 1 = "
                                   "129; prepare more text or lower model.seq_len"]
    assert not (tmp_path / "runs").exists()
