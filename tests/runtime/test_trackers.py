"""monitor.tracker with the real packages, offline: TensorBoard, W&B (offline mode) and MLflow (a file
store) each hold every logged step once after a run that was stopped and resumed twice (the last
attempt on dp=2: rank 0 alone writes). A tracker whose package is missing fails at validate time."""

from __future__ import annotations

import glob
import os
import struct

import pytest
import yaml

from hpctrain.cli import main
from hpctrain.config import job as job_module
from hpctrain.runtime.observe.trackers import read_state

from ._entry import events, make_job, metrics, run_entry

STEPS = list(range(1, 13))


def _wandb_history(wandb_dir: str) -> tuple[list[int], set[str], int]:
    """(every history _step in file order, run ids, offline run folders), read from the .wandb files
    (a leveldb-style log of protobuf Records; wandb ships no reader for offline runs)."""
    from wandb.proto import wandb_internal_pb2 as pb

    steps: list[int] = []
    ids: set[str] = set()
    files = sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")))
    for path in files:
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        pos, block, buf = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 and length == 0:
                break
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST: a whole record
                record = pb.Record()
                record.ParseFromString(buf)
                buf = b""
                which = record.WhichOneof("record_type")
                if which == "run":
                    ids.add(record.run.run_id)
                elif which == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                    if "loss" in items:
                        steps.append(int(items["_step"]))
    return steps, ids, len(files)


def test_every_step_once_after_two_resumes(tmp_path, monkeypatch) -> None:
    wandb_dir = tmp_path / "wandb-home"
    wandb_dir.mkdir()
    # No final checkpoint: each attempt ends after steps its successor does again (4-5, then 10).
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
           "HPCTRAIN_FINAL_CHECKPOINT": "0"}
    run = str(tmp_path / "run")
    monitor = {"tracker": ["tensorboard", "wandb", "mlflow"]}
    for steps, dp in ((5, 1), (10, 1), (12, 2)):
        job = make_job(dp=dp, train={"steps": steps}, checkpoint={"every_steps": 3, "keep_last": 3},
                       monitor=monitor)
        assert run_entry(job, run, env=env) == [0] * dp, steps
    assert [e["step"] for e in events(run) if e["event"] == "resumed"] == [3, 9]  # steps 4-5 and 10 came twice
    final = {m["step"]: m["loss"] for m in metrics(run)}
    assert sorted(final) == STEPS

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run, "tensorboard"))
    acc.Reload()
    scalars = acc.Scalars("loss")
    assert [e.step for e in scalars] == STEPS  # the resumed attempts' purge_step dropped the replaced steps
    assert [e.value for e in scalars] == pytest.approx([final[s] for s in STEPS], rel=1e-6)

    steps, ids, folders = _wandb_history(str(wandb_dir))
    state = read_state(run)
    assert steps == STEPS and ids == {state["wandb_id"]} and folders == 3

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store only when asked
    client = MlflowClient("file://" + os.path.join(run, "mlruns"))
    history = client.get_metric_history(state["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == STEPS
    experiment = client.get_experiment_by_name("runtime-test")
    assert len(client.search_runs([experiment.experiment_id])) == 1
    assert client.get_run(state["mlflow_run_id"]).info.status == "FINISHED"


def test_missing_tracker_package_fails_validation(tmp_path, monkeypatch, capsys) -> None:
    # The packages are installed here (the `test` extra): point the table at a module that does not exist.
    monkeypatch.setitem(job_module.TRACKER_PACKAGES, "wandb", ("hpctrain_no_such_module", "wandb"))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "model": {"preset": "tiny"},
                                    "monitor": {"tracker": ["tensorboard", "wandb"]}}))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "monitor.tracker: wandb needs the hpctrain_no_such_module package" in err[0]
    assert "pip install 'hpctrain[wandb]'" in err[0]
    path.write_text(yaml.safe_dump({"name": "t", "model": {"preset": "tiny"}, "monitor": {"tracker": "tensorboard"}}))
    assert main(["validate", str(path)]) == 0


CRASH = """
import os, signal, sys
from hpctrain.config import job_from_dict
from hpctrain.runtime.observe import trackers as T

run_dir, resumed, first, last, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
job = job_from_dict({"name": "trk", "model": {"preset": "tiny"}, "monitor": {"tracker": ["mlflow"]}})
real = T.MlflowTracker.log

def log_then_die(self, step, values):
    real(self, step, values)  # MLflow's file store holds the step now ...
    if step == kill_at:  # ... and the process dies before anything else happens, as kill -9 does
        os.kill(os.getpid(), signal.SIGKILL)

T.MlflowTracker.log = log_then_die
trackers = T.Trackers(job, run_dir, 0, resumed)
for step in range(first, last + 1):
    trackers.log({"step": step, "loss": 1.0 / step, "time": 0.0})
trackers.close(True)
"""


@pytest.mark.slow
def test_a_kill_right_after_mlflow_wrote_a_step_does_not_log_it_twice(tmp_path, monkeypatch) -> None:
    """Issue 30 Why 7: rank 0 killed after MLflow wrote step N and before trackers.json recorded it gave step
    N twice after the resume. The kill is real (SIGKILL from inside the tracker's write, right after MLflow's
    own write returned: the one moment that matters, which an outside kill hits only by chance)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    run = tmp_path / "run"
    run.mkdir()
    env = {**os.environ, "MLFLOW_ALLOW_FILE_STORE": "true"}
    first = subprocess.run([sys.executable, str(script), str(run), "0", "1", "6", "4"], env=env, timeout=120,
                           capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL, first.stderr
    # the resumed attempt: its checkpoint is at step 2, so steps 3-6 come again
    second = subprocess.run([sys.executable, str(script), str(run), "2", "3", "6", "0"], env=env, timeout=120,
                            capture_output=True, text=True)
    assert second.returncode == 0, second.stderr

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient("file://" + str(run / "mlruns"))
    history = client.get_metric_history(read_state(str(run))["mlflow_run_id"], "loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]  # every step once: 4 is not logged again
