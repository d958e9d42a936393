"""Issue 30, findings 1-4, on a real finished local run (`hpctrain submit --wait`, the tiny preset on CPU).

One run trains 4 steps with checkpoints at steps 2 and 4; each test works on a copy of it:
- finding 3: symbolic links planted at `metrics.jsonl.tmp` and `trackers.json.tmp` do not carry the
  resumed run's writes out of the run directory;
- finding 4: a PID recorded in `submit/local.json` that another live process has now (one that looks
  like another run's supervisor, one that names this run but started later) is not RUNNING, does not
  block `resume`, and is not signalled by `cancel`;
- findings 1 and 2: `export` verifies the checkpoint's manifest (falls back, or refuses `--step`) and
  refuses outputs it would lose or cannot write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ._helpers import log_tail, run_cli, run_dir_of, status_json, tiny_job, write_job

SECRET = "outside the run: must stay as it is\n"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)  # python, and no Slurm client: executor auto -> local
    return {**env, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hardening")
    job = tiny_job("hardening", steps=4, gpu="cpu", checkpoint={"every_steps": 2, "keep_last": 3})
    result = run_cli(["submit", str(write_job(root, job)), "--wait"], cwd=root, env=_env(), timeout_s=180)
    assert result.returncode == 0, result.stderr
    run = run_dir_of(result)
    assert sorted(os.listdir(run / "checkpoints")) == ["owner.json", "step-2", "step-4"], log_tail(run)
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "runs" / run.name
    shutil.copytree(run, copy, symlinks=True)
    return copy


def _outside(tmp_path: Path, name: str) -> Path:
    target = tmp_path / "elsewhere" / name
    target.parent.mkdir(exist_ok=True)
    target.write_text(SECRET)
    return target


def test_planted_links_do_not_carry_the_resumed_runs_writes_out(finished_run: Path, tmp_path: Path) -> None:
    run = _copy(finished_run, tmp_path)
    targets = {}
    for name in ("metrics.jsonl.tmp", "trackers.json.tmp"):
        targets[name] = _outside(tmp_path, name)
        os.symlink(targets[name], run / name)
    result = run_cli(["resume", str(run), "--set", "train.steps=6", "--set", "monitor.tracker=tensorboard", "--wait"],
                     cwd=tmp_path, env=_env(), timeout_s=180)
    assert result.returncode == 0, result.stderr + log_tail(run)
    for name, target in targets.items():
        assert target.read_text() == SECRET, name
    for name in ("metrics.jsonl", "trackers.json"):
        assert (run / name).is_file() and not (run / name).is_symlink(), name
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert json.loads((run / "trackers.json").read_text())["last_step"]["tensorboard"] == 6


def _decoy(argv_tail: list[str]) -> subprocess.Popen[bytes]:
    """A live process whose command line is `python -c <sleep> ARGV_TAIL` (what /proc/PID/cmdline shows)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv_tail],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _record_pid(run: Path, pid: int, **fields: Any) -> None:
    """local.json as a live supervisor writes it, naming `pid`; the submitted event's job id too."""
    state = json.loads((run / "submit" / "local.json").read_text())
    state.update(state="RUNNING", pid=pid, end_time=None, exit_codes=[], **fields)
    (run / "submit" / "local.json").write_text(json.dumps(state))
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    for event in events:
        if event["event"] == "submitted":
            event["job_id"] = f"local-{pid}"
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_recorded_pid_counts_only_while_it_is_this_runs_supervisor(finished_run: Path, tmp_path: Path) -> None:
    run = _copy(finished_run, tmp_path)
    module = "hpctrain.launch.local.supervisor"
    recorded = json.loads((run / "submit" / "local.json").read_text())
    decoys = {
        # another run's supervisor has the pid now (a reboot reused it)
        "another run": (_decoy(["-m", module, str(tmp_path / "other-run" / "submit" / "local-spec.json")]), {}),
        # a process that names this run but is not the one recorded: it started at another time
        "started later": (_decoy(["-m", module, str(run / "submit" / "local-spec.json")]),
                          {"pid_start": recorded.get("pid_start", 1)}),
    }
    try:
        for what, (decoy, fields) in decoys.items():
            _record_pid(run, decoy.pid, **fields)
            status = status_json(run, _env())
            assert status["state"] == "FAILED" and status["reason"] == "the local supervisor process is gone", what
            cancel = run_cli(["cancel", str(run)], cwd=tmp_path, env=_env(), timeout_s=60)
            assert cancel.returncode == 0 and "had already ended" in cancel.stdout, (what, cancel.stdout, cancel.stderr)
            assert decoy.poll() is None, f"{what}: cancel signalled pid {decoy.pid}"
            resume = run_cli(["resume", str(run), "--dry-run"], cwd=tmp_path, env=_env(), timeout_s=60)
            assert resume.returncode == 0, (what, resume.stderr)
            doctor = run_cli(["doctor", str(run), "--json", "--no-scheduler"], cwd=tmp_path, env=_env(), timeout_s=60)
            assert json.loads(doctor.stdout)["state"] != "running", what
    finally:
        for decoy, _ in decoys.values():
            decoy.kill()
            decoy.wait()


def _flip_bytes(path: Path) -> None:
    """Damage a file the way a bad disk or a stray write does: same size, other bytes in the middle."""
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_export_verifies_the_checkpoint_and_refuses_outputs_it_would_lose(finished_run: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from hpctrain.cli import main as cli_main

    run = _copy(finished_run, tmp_path)
    checkpoints = run / "checkpoints"

    def refused(out: str, *extra: str) -> str:
        assert cli_main(["export", str(run), "-o", out, *extra]) == 2, out
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err  # one line, no traceback
        return err[0]

    # Finding 2: outputs that a resume would rotate away or read as a checkpoint, a dangling link, /proc.
    for out in (checkpoints / "step-2" / "hf", checkpoints / "step-99", checkpoints):
        assert refused(str(out)).startswith(f"-o {out}: is inside the run's checkpoint folder {checkpoints}")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    assert refused(str(tmp_path / "dangling")) == (f"-o {tmp_path / 'dangling'}: is a symbolic link to "
                                                   f"{tmp_path / 'nowhere'}, which does not exist; give the "
                                                   "folder's own path")
    assert refused("/proc/hpctrain-export").startswith("-o /proc/hpctrain-export: cannot write there: /proc is "
                                                       "not writable")
    assert sorted(os.listdir(checkpoints)) == ["owner.json", "step-2", "step-4"]  # nothing was written there

    # Finding 1: a damaged newest checkpoint is passed over (one notice), a damaged --step refused.
    assert cli_main(["export", str(run), "-o", str(tmp_path / "older"), "--step", "2"]) == 0
    capsys.readouterr()
    distcp = sorted((checkpoints / "step-4").glob("*.distcp"))
    assert distcp
    _flip_bytes(distcp[0])
    assert cli_main(["export", str(run), "-o", str(tmp_path / "fallback")]) == 0
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        f"hpctrain export: skipping damaged checkpoint step-4 (the file {distcp[0].name} checksum mismatch "
        "(corrupted after it was written)); exporting step-2, the newest intact one"]
    assert "exported step-2" in out
    older, fallback = _weights(tmp_path / "older"), _weights(tmp_path / "fallback")
    assert older.keys() == fallback.keys() and all(torch.equal(older[k], fallback[k]) for k in older)
    assert refused(str(tmp_path / "damaged"), "--step", "4").startswith(
        f"--step: got 4; {checkpoints / 'step-4'} is damaged (the file {distcp[0].name} checksum mismatch")
    assert not (tmp_path / "damaged").exists()
