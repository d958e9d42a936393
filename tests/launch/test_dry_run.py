"""`submit --dry-run` and `sweep --dry-run` need no scheduler: with no sbatch on PATH, for any executor,
they write the script Slurm would get (the sweep's with --array) and the recipe, and submit nothing."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ._helpers import REPO, run_cli, run_dir_of


@pytest.fixture
def no_sbatch_env() -> dict[str, str]:
    """The CLI's environment: only the interpreter's folder on PATH (no sbatch there), no Slurm variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    assert not (Path(env["PATH"]) / "sbatch").exists(), "the interpreter's folder holds an sbatch"
    return env


def _dry_run(args: list[str], tmp_path: Path, env: dict[str, str]) -> tuple[Path, str]:
    result = run_cli([*args, "--dry-run"], cwd=tmp_path, env=env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    run_dir = run_dir_of(result)
    script, recipe = run_dir / "submit" / "job.sbatch", run_dir / "submit" / "recipe.def"
    assert f"dry run: nothing submitted; script {script}; recipe {recipe}" in result.stdout
    assert script.is_file() and recipe.read_text().startswith("Bootstrap:")
    assert not list((run_dir / "submit").glob("*_submission.sh"))  # submitit never ran
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["dry_run"]
    return run_dir, script.read_text()


def test_submit_dry_run_executor_slurm_without_sbatch(tmp_path: Path, no_sbatch_env: dict[str, str]) -> None:
    run_dir, script = _dry_run(["submit", str(REPO / "examples" / "gpt3-175b.yaml")], tmp_path, no_sbatch_env)
    assert "#SBATCH --nodes=128" in script and "#SBATCH --array" not in script
    assert f"RUN_DIR={run_dir}\n" in script


def test_sweep_dry_run_executor_slurm_without_sbatch(tmp_path: Path, no_sbatch_env: dict[str, str]) -> None:
    run_dir, script = _dry_run(["sweep", str(REPO / "examples" / "llama3-8b-sweep.yaml")], tmp_path, no_sbatch_env)
    assert "#SBATCH --array=0-6%4" in script
    assert (run_dir / "tasks" / "6" / "job.resolved.yaml").is_file()


@pytest.mark.parametrize("executor", ["local", "auto"])
def test_local_sweep_dry_run_writes_the_array_script(tmp_path: Path, no_sbatch_env: dict[str, str],
                                                     executor: str) -> None:
    args = ["sweep", str(REPO / "examples" / "quickstart.yaml"), "--grid", "train.lr_schedule.warmup_steps=1,2",
            "--set", f"cluster.executor={executor}"]
    run_dir, script = _dry_run(args, tmp_path, no_sbatch_env)
    assert "#SBATCH --array=0-1%2" in script
    assert not (run_dir / "submit" / "supervisor.log").exists()  # no local process started


def test_local_submit_dry_run_writes_the_script(tmp_path: Path, no_sbatch_env: dict[str, str]) -> None:
    _, script = _dry_run(["submit", str(REPO / "examples" / "quickstart.yaml")], tmp_path, no_sbatch_env)
    assert "#SBATCH --ntasks-per-node=2" in script


def test_submit_without_dry_run_still_needs_sbatch(tmp_path: Path, no_sbatch_env: dict[str, str]) -> None:
    result = run_cli(["submit", str(REPO / "examples" / "gpt3-175b.yaml")], cwd=tmp_path, env=no_sbatch_env)
    assert result.returncode == 2 and "sbatch" in result.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("field", ["train.data", "train.eval_data"])
def test_local_dry_run_refuses_a_token_file_that_is_not_there(tmp_path: Path, no_sbatch_env: dict[str, str],
                                                              field: str) -> None:
    # Issue 29: `submit --dry-run` said nothing of a train.data that does not exist; the real submit then
    # refused it. A dry run the local executor could submit checks the files as the submit would.
    sets = ["--set", f"{field}={tmp_path / 'missing.bin'}"]
    if field == "train.eval_data":
        (tmp_path / "train.bin").write_bytes(bytes(range(256)) * 8)
        sets += ["--set", f"train.data={tmp_path / 'train.bin'}", "--set", "train.eval_every=5"]
    result = run_cli(["submit", str(REPO / "examples" / "quickstart.yaml"), *sets, "--dry-run"], cwd=tmp_path,
                     env=no_sbatch_env, timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{field}: no such file (got {str(tmp_path / 'missing.bin')!r}); make it with "
        "`hpctrain data prepare INPUTS -o FILE`, or use 'synthetic'"]
    assert not (tmp_path / "runs").exists()  # nothing written


def test_local_sweep_dry_run_refuses_a_token_file_that_is_not_there(tmp_path: Path,
                                                                    no_sbatch_env: dict[str, str]) -> None:
    missing = tmp_path / "missing.bin"
    result = run_cli(["sweep", str(REPO / "examples" / "quickstart.yaml"), "--grid", "train.seed=1,2",
                      "--set", f"train.data={missing}", "--dry-run"], cwd=tmp_path, env=no_sbatch_env, timeout_s=60)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and all(f"train.data: no such file (got {str(missing)!r})" in line for line in lines)
    assert lines[0].startswith("train.seed=1: ") and lines[1].startswith("train.seed=2: ")
    assert not (tmp_path / "runs").exists()
