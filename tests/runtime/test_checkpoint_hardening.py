"""Issue 18: checkpoints that are damaged, foreign, unsafe to unpickle, unwritable or on a full disk."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.rundir.checkpoints import OWNER_FILE, checksum, file_sha256, read_metadata, scan

from ._entry import copy_run, events, make_job, metrics, run_entry, run_module, write_job


def _steps(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("step-"))


def _garble(path: str) -> None:
    """Same size, different bytes: only a checksum of the contents can tell."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\xde\xad\xbe\xef" * 16)


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_finding5_a_damaged_data_file_falls_back_to_the_newest_intact_checkpoint(victim, tmp_path) -> None:
    job = make_job(train={"steps": 6}, checkpoint={"every_steps": 2, "keep_last": 3})
    full = str(tmp_path / "full")
    assert run_entry(job, full) == [0]
    run = copy_run(full, str(tmp_path / "run"))
    ck = os.path.join(run, "checkpoints")
    _garble(os.path.join(ck, "step-6", victim))
    read_metadata(os.path.join(ck, "step-6"))  # the cheap checks (and metadata.json) still pass
    job["train"]["steps"] = 7
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run])
    assert proc.returncode == 0, proc.stderr
    assert f"step-6: the file {victim} checksum mismatch" in proc.stderr
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [4]
    skipped = [e for e in events(run) if e["event"] == "checkpoint skipped"]
    assert [os.path.basename(e["path"]) for e in skipped] == ["step-6"] and victim in skipped[0]["reason"]
    assert os.path.isdir(os.path.join(ck, "step-6.corrupt"))  # kept for a look, out of the way
    assert _steps(ck) == ["step-4", "step-6", "step-6.corrupt", "step-7"]
    curve = [(m["loss"], m["grad_norm"]) for m in metrics(run)[:6]]
    assert curve == [(m["loss"], m["grad_norm"]) for m in metrics(full)]  # steps 5 and 6 redone bit-identically


def test_finding5_no_intact_checkpoint_stops_instead_of_starting_afresh(tmp_path) -> None:
    """Nothing already saved is lost: with every checkpoint damaged, the run does not restart from
    step 1 over them; it exits 2 and leaves the folders where they are."""
    job = make_job(train={"steps": 2}, checkpoint={"every_steps": 2, "keep_last": 3})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [0]
    ck = os.path.join(run, "checkpoints")
    _garble(os.path.join(ck, "step-2", "__0_0.distcp"))
    job["train"]["steps"] = 4
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run])
    assert proc.returncode == 2, proc.stderr
    assert "none of its 1 checkpoint(s) passed verification (step-2:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert _steps(ck) == ["step-2"]
    assert [m["step"] for m in metrics(run)] == [1, 2]  # no second step 1


def test_finding5_a_damaged_shard_of_rank_1_falls_back_on_every_rank(tmp_path) -> None:
    job = make_job(dp=2, train={"steps": 4, "micro_batch": 1}, checkpoint={"every_steps": 2, "keep_last": 2})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [0, 0]
    step4 = os.path.join(run, "checkpoints", "step-4")
    shards = sorted(n for n in os.listdir(step4) if n.startswith("__1_"))
    assert shards, os.listdir(step4)
    _garble(os.path.join(step4, shards[0]))
    job["train"]["steps"] = 5
    assert run_entry(job, run) == [0, 0]
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [2]
    assert _steps(os.path.join(run, "checkpoints")) == ["step-4", "step-4.corrupt", "step-5"]


def test_finding2_a_second_run_refuses_the_first_runs_checkpoint_dir(tmp_path) -> None:
    shared = str(tmp_path / "shared-ckpt")
    first = make_job(train={"steps": 4}, checkpoint={"every_steps": 2, "dir": shared})
    assert run_entry(first, str(tmp_path / "first")) == [0]
    second = make_job(train={"steps": 6, "optimizer": {"lr": 0.01}}, checkpoint={"every_steps": 2, "dir": shared})
    second["name"] = "another-run"
    job_path = write_job(second, str(tmp_path / "second.yaml"))
    proc = run_module(["--job", job_path, "--run-dir", str(tmp_path / "second")])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if "checkpoint.dir" in ln]
    assert len(line) == 1 and "holds the checkpoints of another run" in line[0]
    assert str(tmp_path / "first") in line[0] and "checkpoint.adopt" in line[0]
    assert not (tmp_path / "second" / "metrics.jsonl").exists()
    assert _steps(shared) == ["step-2", "step-4"]  # untouched
    # The same run, requeued or resumed (same run directory): its own checkpoints.
    first["train"]["steps"] = 6
    assert run_entry(first, str(tmp_path / "first")) == [0]
    assert [e["step"] for e in events(str(tmp_path / "first")) if e["event"] == "resumed"] == [4]
    # On purpose: checkpoint.adopt.
    second["checkpoint"]["adopt"] = True
    proc = run_module(["--job", write_job(second, job_path), "--run-dir", str(tmp_path / "second")])
    assert proc.returncode == 0, proc.stderr
    assert [e["step"] for e in events(str(tmp_path / "second")) if e["event"] == "resumed"] == [6]
    owner = json.loads((Path(shared) / OWNER_FILE).read_text())
    assert owner["dir"] == str(tmp_path / "second")


def test_finding2_the_login_path_refuses_a_foreign_checkpoint_dir(tmp_path) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.launch.stages import check_checkpoint_dir

    run = str(tmp_path / "run")
    assert run_entry(make_job(train={"steps": 2}, checkpoint={"every_steps": 2}), run) == [0]
    folder = Path(run) / "checkpoints"
    check_checkpoint_dir(folder, Path(run), adopt=False)  # its own run: fine
    with pytest.raises(ConfigError, match="holds the checkpoints of another run"):
        check_checkpoint_dir(folder, None, adopt=False)  # a new run
    check_checkpoint_dir(folder, None, adopt=True)


_PAYLOAD = "import pathlib; pathlib.Path({marker!r}).write_text('ran')"


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # what a hostile writer of a shared checkpoint folder can put in a pickle
        return (exec, (_PAYLOAD.format(marker=self.marker),))


def test_finding4_an_rng_file_is_never_unpickled(tmp_path) -> None:
    import torch

    job = make_job(train={"steps": 2}, checkpoint={"every_steps": 2})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [0]
    step2 = os.path.join(run, "checkpoints", "step-2")
    rng = os.path.join(step2, "rng", "rank-0.pt")
    assert set(torch.load(rng, weights_only=True)) >= {"torch", "numpy", "python"}  # plain tensors and numbers
    marker = tmp_path / "pwned"
    _forge(step2, "rng/rank-0.pt", pickle.dumps({"torch": _Exploit(str(marker))}))
    job["train"]["steps"] = 3
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run])
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert "rng/rank-0.pt: not a plain-tensor RNG file" in proc.stderr


def _forge(folder: str, name: str, payload: bytes) -> None:
    """Replace a file of a checkpoint and fix its manifest entry and the metadata checksum, as anyone who
    can write the folder can: checksums are no defence against a writer."""
    with open(os.path.join(folder, name), "wb") as handle:
        handle.write(payload)
    meta_path = os.path.join(folder, "metadata.json")
    body = {k: v for k, v in json.load(open(meta_path)).items() if k != "sha256"}
    body["files"][name] = {"bytes": len(payload), "sha256": file_sha256(os.path.join(folder, name))}
    json.dump({**body, "sha256": checksum(body)}, open(meta_path, "w"))


def test_finding4_a_hostile_dcp_index_is_refused_and_the_older_checkpoint_used(tmp_path) -> None:
    job = make_job(train={"steps": 4}, checkpoint={"every_steps": 2})
    run = str(tmp_path / "run")
    assert run_entry(job, run) == [0]
    marker = tmp_path / "pwned"
    _forge(os.path.join(run, "checkpoints", "step-4"), ".metadata", pickle.dumps(_Exploit(str(marker))))
    job["train"]["steps"] = 5
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run])
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert "step-4: the DCP index .metadata refers to builtins.exec" in proc.stderr
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [2]


def test_finding4_non_tensor_entries_are_loaded_with_weights_only(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp
    from hpctrain.runtime.checkpoint.safe_dcp import SafePlanner, SafeReader

    marker = tmp_path / "pwned"
    folder = str(tmp_path / "ckpt")
    dcp.save({"optim": {"lr": _Exploit(str(marker))}}, checkpoint_id=folder)  # a non-tensor entry: bytes
    with pytest.raises(BaseException) as refused:  # DCP wraps it in CheckpointException (a BaseException)
        dcp.load({"optim": {"lr": 0.1}}, storage_reader=SafeReader(folder), planner=SafePlanner())
    assert not marker.exists(), refused.value
    dcp.load({"optim": {"lr": 0.1}}, checkpoint_id=folder)  # DCP's own planner: the code runs
    assert marker.exists()


@contextlib.contextmanager
def _tmpfs(path: Path, options: str) -> Iterator[Path]:
    """A real small or read-only file system (needs root; a mock could not show what the kernel says)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_finding8_a_full_file_system_is_named_when_the_writer_hides_enospc(tmp_path) -> None:
    """torch's zip writer (torch.save) checks its position after a short write and raises its own RuntimeError
    ("unexpected pos ..."): the save's reason reads the file system instead of the message."""
    from hpctrain.runtime.checkpoint.files import FULL_FREE_BYTES, describe_failure

    hidden = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    with _tmpfs(tmp_path / "full", "size=2M") as full:
        assert describe_failure(hidden, str(full)) == "RuntimeError: [enforce fail at inline_container.cc:672] . " \
                                                     "unexpected pos 704 vs 598"  # room left: the error as it is
        with open(full / "filler", "wb") as handle:
            try:
                while True:
                    handle.write(b"\0" * 65536)
                    handle.flush()
            except OSError:
                pass
        assert shutil.disk_usage(full).free < FULL_FREE_BYTES
        assert describe_failure(hidden, str(full)) == "no space left on device"
        assert describe_failure(hidden) == describe_failure(hidden, str(tmp_path))  # no folder, or room: as it is


def test_finding8_a_read_only_checkpoint_dir_fails_at_start(tmp_path) -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.launch.stages import check_checkpoint_dir

    with _tmpfs(tmp_path / "ro", "ro,size=1M") as ro:
        job = make_job(train={"steps": 4}, checkpoint={"every_steps": 2, "dir": str(ro / "ckpt")})
        proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", str(tmp_path / "run")])
        with pytest.raises(ConfigError, match="is not writable"):
            check_checkpoint_dir(ro / "ckpt", None, adopt=False)  # and at submit, on the login node
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"checkpoint.dir {ro / 'ckpt'}: cannot write there" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not a step trained in vain


@pytest.mark.parametrize("dp", [1, 2])
def test_finding8_a_full_disk_is_reported_as_such(dp, tmp_path) -> None:
    with _tmpfs(tmp_path / "small", "size=2M") as small:  # a checkpoint of this model is ~3.5 MB
        folder = small / "ckpt"
        job = make_job(dp=dp, train={"steps": 4, "micro_batch": 1},
                       checkpoint={"every_steps": 2, "dir": str(folder)})
        run = str(tmp_path / "run")
        codes = run_entry(job, run)
        left = os.listdir(folder)
    assert codes == [1] * dp
    failed = [e for e in events(run) if e["event"] == "checkpoint failed"]
    assert [e["reason"] for e in failed] == ["no space left on device"]
    step = failed[0]["step"]
    final = [e for e in events(run) if e["event"] == "failed"]
    expected = f"no space left on device while saving checkpoint step {step} to {folder}"
    assert final and all(e["reason"] == expected for e in final)
    assert not any("CheckpointException" in json.dumps(e) for e in events(run))
    assert OWNER_FILE in left and f"step-{step}.partial" not in left  # the space is given back
    assert all(n == OWNER_FILE or int(n.split("-")[1]) < step for n in left)  # older ones stay, intact


def test_finding2_a_run_that_lost_its_run_id_file_still_owns_its_checkpoints(tmp_path) -> None:
    run = str(tmp_path / "run")
    job = make_job(train={"steps": 2}, checkpoint={"every_steps": 2})
    assert run_entry(job, run) == [0]
    os.remove(os.path.join(run, "run_id"))  # the run directory is the same run: its path is recorded too
    job["train"]["steps"] = 3
    assert run_entry(job, run) == [0]
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [2]


def test_finding2_sweep_points_sharing_a_checkpoint_dir_are_refused(tmp_path) -> None:
    import sys

    from ._entry import REPO

    job = make_job(checkpoint={"every_steps": 2, "dir": str(tmp_path / "ckpt")})
    job["runs_dir"] = str(tmp_path / "runs")
    job["sweep"] = {"grid": {"train.optimizer.lr": [0.001, 0.002]}}
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "sweep", write_job(job, str(tmp_path / "job.yaml"))],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert f"checkpoint.dir {tmp_path / 'ckpt'}: shared by 2 points of the sweep" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_fifos_in_a_checkpoint_folder_never_block(tmp_path) -> None:
    from hpctrain.rundir.checkpoints import foreign_owner, run_identity

    (tmp_path / "step-3").mkdir()
    os.mkfifo(tmp_path / "step-3" / "metadata.json")
    os.mkfifo(tmp_path / OWNER_FILE)
    found = scan(str(tmp_path))
    assert found.newest is None
    assert found.rejected == [(str(tmp_path / "step-3"), "metadata.json is not a regular file")]
    assert foreign_owner(str(tmp_path), "0" * 32) is None
    os.mkfifo(tmp_path / "run_id")
    with pytest.raises(Exception, match="is not a regular file"):
        run_identity(str(tmp_path))


_LOGIN_SCAN = """
import subprocess, sys
subprocess.Popen = None  # the login path must not start a `python -c` child to scan (issue 11 item 5)
from pathlib import Path
from hpctrain.launch.stages import newest_complete_checkpoint
newest, rejected = newest_complete_checkpoint(Path(sys.argv[1]))
assert "torch" not in sys.modules, "the login path imported torch"
print(newest.name, len(rejected))
"""


def test_issue11_checkpoint_discovery_on_the_login_path_is_torch_free_and_in_process(tmp_path) -> None:
    import sys

    from hpctrain.rundir.checkpoints import write_metadata

    from ._entry import REPO

    for step in (2, 4):
        folder = tmp_path / f"step-{step}"
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"index")
        write_metadata(str(folder), {"step": step, "files": {".metadata": {"bytes": 5, "sha256": "x"}}})
    (tmp_path / "step-4" / ".metadata").write_bytes(b"trunc")  # same size: only the ranks' hash sees it
    (tmp_path / "step-6.partial").mkdir()
    proc = subprocess.run([sys.executable, "-c", _LOGIN_SCAN, str(tmp_path)], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["step-4", "1"]
