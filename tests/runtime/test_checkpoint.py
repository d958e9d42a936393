"""Atomic checkpoints and bit-identical resume (issue 3 item 9, issue 7 items 1, 2, 6)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hpctrain.runtime.checkpoint.checkpointer import InvalidCheckpoint, checksum, read_metadata, scan, write_metadata

from ._entry import copy_run, events, make_job, metrics, run_entry, run_module, write_job


def _ckpts(run_dir: str) -> list[str]:
    """The step folders (beside them: owner.json, the run that owns the folder)."""
    return sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.startswith("step-"))


def _same_curve(a: str, b: str) -> None:
    """Bit-identical losses and gradient norms, each step exactly once."""
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in mb] == [m["step"] for m in ma]
    assert [(m["loss"], m["grad_norm"], m["lr"]) for m in mb] == [(m["loss"], m["grad_norm"], m["lr"]) for m in ma]


@pytest.mark.parametrize(
    "layout",
    [
        dict(),  # one process
        dict(tp=2, dp=2, train={"micro_batch": 1}, checkpoint={"async": True}),  # tp2 x dp2, FSDP, async
        dict(pp=2, model={"layers": 4, "tie_embeddings": True},  # two model parts per rank, tied copies
             train={"micro_batch": 1, "global_batch": 4},
             parallel={"schedule": "interleaved-1f1b", "virtual_stages": 2}),
    ],
    ids=["single", "tp2xdp2", "pp2-interleaved-tied"],
)
def test_resume_is_bit_identical(layout, tmp_path) -> None:
    """Run 6 steps; then 'crash' after step 5 (metrics logged up to 5, last checkpoint at 3) and
    restart: the run resumes from step 3, cuts metrics back to 3, and reproduces steps 4-6 exactly."""
    layout = dict(layout)
    sections = {k: layout.pop(k) for k in ("train", "model", "parallel", "checkpoint") if k in layout}
    job = make_job(**layout, **sections)
    full = str(tmp_path / "full")
    world = len(run_entry(job, full))
    assert _ckpts(full) == ["step-3", "step-6"]
    crashed = copy_run(full, str(tmp_path / "crashed"))
    shutil.rmtree(os.path.join(crashed, "checkpoints", "step-6"))
    with open(os.path.join(crashed, "metrics.jsonl")) as handle:
        lines = handle.readlines()
    with open(os.path.join(crashed, "metrics.jsonl"), "w") as handle:
        handle.writelines(lines[:5] + [lines[5][:20]])  # a torn line, as a kill mid-write leaves
    assert run_entry(job, crashed) == [0] * world
    _same_curve(full, crashed)
    assert [e["step"] for e in events(crashed) if e["event"] == "resumed"] == [3]
    meta = read_metadata(os.path.join(crashed, "checkpoints", "step-6"))
    assert meta["step"] == 6 and meta["data"]["samples_seen"] == 6 * job["train"]["global_batch"]
    assert meta["tokens_seen"] == 6 * job["train"]["global_batch"] * job["model"]["seq_len"]
    assert len(meta["rng_files"]) == world


def test_corrupt_and_missing_metadata_are_skipped_with_a_message(tmp_path) -> None:
    job = make_job(train={"steps": 6}, checkpoint={"every_steps": 2, "keep_last": 5})
    full = str(tmp_path / "full")
    assert run_entry(job, full) == [0]
    run = copy_run(full, str(tmp_path / "run"))
    ck = os.path.join(run, "checkpoints")
    os.remove(os.path.join(ck, "step-6", "metadata.json"))  # killed between DCP write and metadata
    path = os.path.join(ck, "step-4", "metadata.json")
    body = json.load(open(path))
    body["step"], body["data"]["samples_seen"] = 4, 999  # edited: checksum no longer matches
    json.dump(body, open(path, "w"))
    os.makedirs(os.path.join(ck, "step-8.partial"))  # a save that never got renamed
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", run])
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint" in proc.stderr and "step-6: no metadata.json" in proc.stderr
    assert "step-4: metadata.json checksum mismatch" in proc.stderr and "step-8.partial: partial" in proc.stderr
    skipped = [e["path"] for e in events(run) if e["event"] == "checkpoint skipped"]
    assert sorted(os.path.basename(p) for p in skipped) == ["step-4", "step-6", "step-8.partial"]
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [2]
    _same_curve(full, run)
    assert {"step-4", "step-6"} <= set(_ckpts(run)) and "step-8.partial" in _ckpts(run)
    for step in (4, 6):  # re-saved, valid again
        assert read_metadata(os.path.join(ck, f"step-{step}"))["step"] == step


def test_keep_last_and_stale_partials(tmp_path) -> None:
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "checkpoints", "step-1.partial"))
    job = make_job(train={"steps": 5}, checkpoint={"every_steps": 1, "keep_last": 2})
    assert run_entry(job, run) == [0]
    assert _ckpts(run) == ["step-4", "step-5"]
    saved = [e["step"] for e in events(run) if e["event"] == "checkpoint saved"]
    assert saved == [1, 2, 3, 4, 5]


def test_checkpoint_final_false_skips_only_the_last_save(tmp_path) -> None:
    # Issue 29: the final save was always written; only an undocumented environment variable turned it off.
    run = str(tmp_path / "run")
    job = make_job(train={"steps": 3}, checkpoint={"every_steps": 2, "final": False})
    assert run_entry(job, run) == [0]
    assert _ckpts(run) == ["step-2"]


def test_resume_from_explicit_checkpoint_and_async_save(tmp_path) -> None:
    job = make_job(train={"steps": 6}, checkpoint={"every_steps": 3, "async": True})
    full = str(tmp_path / "full")
    assert run_entry(job, full) == [0]
    assert _ckpts(full) == ["step-3", "step-6"]  # async saves complete (metadata written after the wait)
    other = str(tmp_path / "other")
    assert run_entry(job, other, None, "--resume-from", os.path.join(full, "checkpoints", "step-3")) == [0]
    assert [m["step"] for m in metrics(other)] == [4, 5, 6]
    assert [m["loss"] for m in metrics(other)] == [m["loss"] for m in metrics(full)][3:]


def test_resume_from_a_bad_path_is_a_user_error(tmp_path) -> None:
    job = write_job(make_job(), str(tmp_path / "job.yaml"))
    proc = run_module(["--job", job, "--run-dir", str(tmp_path / "run"), "--resume-from", str(tmp_path)])
    assert proc.returncode == 2
    assert "--resume-from" in proc.stderr and "no complete checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_metadata_checksum_and_scan(tmp_path) -> None:
    folder = tmp_path / "step-7"
    folder.mkdir()
    with pytest.raises(InvalidCheckpoint, match="no metadata.json"):
        read_metadata(str(folder))
    write_metadata(str(folder), {"step": 7, "x": [1.5, 2]})
    with pytest.raises(InvalidCheckpoint, match="DCP index"):
        read_metadata(str(folder))
    (folder / ".metadata").write_bytes(b"")
    assert read_metadata(str(folder)) == {"step": 7, "x": [1.5, 2]}
    assert checksum({"b": 1, "a": 2}) == checksum({"a": 2, "b": 1})
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "metadata.json").write_text("{not json")
    (tmp_path / "step-3.partial").mkdir()
    found = scan(str(tmp_path))
    assert found.newest == (7, str(folder))
    assert [os.path.basename(p) for p, _ in found.rejected] == ["step-3.partial", "step-9"]


# Runs the entry point with write_metadata wrapped: once the step-KILL_STEP metadata is in its .partial
# folder (every rank's DCP shards written, the rename not done yet), the process SIGKILLs itself.
_KILL_IN_SAVE = """
import os, signal, sys
import hpctrain.runtime.checkpoint.checkpointer as checkpoint
original = checkpoint.write_metadata
def write_then_die(folder, body):
    original(folder, body)
    if body["step"] == int(os.environ["KILL_STEP"]):
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.write_metadata = write_then_die
from hpctrain.runtime.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_between_dcp_write_and_rename_loads_the_previous_checkpoint(tmp_path) -> None:
    import subprocess
    import sys

    from ._entry import REPO

    job = write_job(make_job(train={"steps": 6}, checkpoint={"every_steps": 2, "keep_last": 5}),
                    str(tmp_path / "job.yaml"))
    run = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE") and not k.startswith("SLURM_")}
    killed = subprocess.run([sys.executable, "-c", _KILL_IN_SAVE, "--job", job, "--run-dir", run], cwd=REPO,
                            env={**env, "KILL_STEP": "4"}, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert _ckpts(run) == ["step-2", "step-4.partial"]  # DCP data and metadata there, never renamed
    before = metrics(run)
    # Step 4's finalize runs in a thread while training goes on (at most until step 6's save waits for it).
    assert [m["step"] for m in before][:4] == [1, 2, 3, 4] and len(before) <= 6
    proc = run_module(["--job", job, "--run-dir", run])
    assert proc.returncode == 0, proc.stderr
    assert "step-4.partial: partial: the save was interrupted before its rename" in proc.stderr
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [2]
    after = metrics(run)
    assert [m["step"] for m in after] == [1, 2, 3, 4, 5, 6]
    assert [(m["loss"], m["grad_norm"]) for m in after[:len(before)]] == [(m["loss"], m["grad_norm"]) for m in before]
    assert _ckpts(run) == ["step-2", "step-4", "step-6"]  # step 4 saved again, complete this time


def test_resuming_an_older_step_sets_later_checkpoints_aside(tmp_path) -> None:
    run = str(tmp_path / "run")
    job = make_job(train={"steps": 6}, checkpoint={"every_steps": 2, "keep_last": 2})
    assert run_entry(job, run) == [0]
    assert _ckpts(run) == ["step-4", "step-6"]
    # Back to step 4 in the same run: step-6 belongs to the abandoned timeline and must not be resumed from
    # (or keep the new saves from being kept).
    job["train"]["steps"] = 7
    assert run_entry(job, run, None, "--resume-from", os.path.join(run, "checkpoints", "step-4")) == [0]
    complete = [os.path.basename(path) for _, path in scan(os.path.join(run, "checkpoints")).complete]
    assert complete == ["step-6", "step-7"]  # the NEW step-6 and step-7
    assert os.path.isdir(os.path.join(run, "checkpoints", "step-6.superseded"))
    assert [e["step"] for e in events(run) if e["event"] == "checkpoint superseded"] == [6]


def test_a_missing_rng_file_makes_the_checkpoint_incomplete(tmp_path) -> None:
    run = str(tmp_path / "run")
    assert run_entry(make_job(train={"steps": 2}, checkpoint={"every_steps": 2}), run) == [0]
    folder = os.path.join(run, "checkpoints", "step-2")
    read_metadata(folder)
    open(os.path.join(folder, "rng", "rank-0.pt"), "wb").close()  # emptied, as by a crash before fsync
    with pytest.raises(InvalidCheckpoint, match="RNG state rng/rank-0.pt"):
        read_metadata(folder)


def test_gpu_index_never_wraps_two_ranks_onto_one_gpu() -> None:
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.distributed import _gpu_index

    assert _gpu_index(3, 1) == 0  # srun --gpus-per-task=1: each task sees only its own GPU
    assert _gpu_index(3, 8) == 3
    with pytest.raises(ConfigError, match="local rank 4 but only 2 GPU"):
        _gpu_index(4, 2)


def test_resume_onto_a_pipeline_with_a_tied_head(tmp_path) -> None:
    """A tied head is one parameter without pipelining and its own copy on a pipeline's last stage
    (checkpoint/tied.py): a checkpoint saved by one process loads onto pp2 (the head's weights and
    optimizer state from the embedding's) and onto one process again, on the curve of one process."""
    shape = dict(model={"layers": 4, "tie_embeddings": True}, train={"micro_batch": 1, "global_batch": 4})
    job = make_job(**shape)
    full = str(tmp_path / "full")
    assert run_entry(job, full) == [0]
    run = copy_run(full, str(tmp_path / "run"))
    shutil.rmtree(os.path.join(run, "checkpoints", "step-6"))
    with open(os.path.join(run, "metrics.jsonl")) as handle:
        lines = handle.readlines()
    with open(os.path.join(run, "metrics.jsonl"), "w") as handle:
        handle.writelines(lines[:3])
    assert run_entry(make_job(pp=2, **shape), run) == [0, 0]
    ma, mb = metrics(full), metrics(run)
    assert [m["step"] for m in mb] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(ma[3:], mb[3:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
