"""Issue 29 items 1 and 4: what the runtime checks at every start, before any step, on this CPU machine.

- A job whose cluster.gpu names a GPU stops with exit 2 on a rank without a usable CUDA device (torch
  here is a CPU build), with a `failed` event, unless runtime.allow_cpu; the `started` event then says
  on what device and with which torch it trained.
- A token file the run trained on, re-prepared in place from another text, stops the next start (exit 2).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from ._entry import REPO, events, make_job, run_module, write_job

ROOT = Path(REPO)


def _run(job: dict, tmp_path, run) -> subprocess.CompletedProcess:
    return run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", str(run)])


def test_gpu_job_on_this_cpu_machine_exits_2_before_any_step(tmp_path) -> None:
    run = tmp_path / "run"
    job = make_job(train={"steps": 2}, cluster={"gpu": "h100-80gb"})
    proc = _run(job, tmp_path, run)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "python -m hpctrain.runtime: cluster.gpu: 'h100-80gb' but this rank has no usable CUDA device" in proc.stderr
    assert not (run / "metrics.jsonl").exists()  # not one step
    [failed] = [e for e in events(str(run)) if e["event"] == "failed"]
    assert failed["exit_code"] == 2 and "no usable CUDA device" in failed["reason"]
    assert not [e for e in events(str(run)) if e["event"] == "started"]

    # Told to: it trains, and the started event says on what and with which torch.
    job["runtime"] = {"allow_cpu": True}
    proc = _run(job, tmp_path, run)
    assert proc.returncode == 0, proc.stderr
    [started] = [e for e in events(str(run)) if e["event"] == "started"]
    assert started["device"] == "cpu" and started["gpu"] == "h100-80gb"
    assert started["torch"] == str(torch.__version__) and started["cuda"] == torch.version.cuda
    assert started["layout"]["dp"] == 1 and started["layout"]["tp"] == 1
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def _prepare(source: str, out: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "data", "prepare", source, "-o", out],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_a_token_file_prepared_again_in_place_stops_the_next_start(tmp_path) -> None:
    data, run = str(tmp_path / "d2.bin"), tmp_path / "run"
    _prepare(str(ROOT / "README.md"), data)
    job = make_job(train={"steps": 2, "data": data}, checkpoint={"every_steps": 2})
    assert _run(job, tmp_path, run).returncode == 0
    recorded = json.loads((run / "data.json").read_text())[data]
    assert recorded["field"] == "train.data" and recorded["sidecar_sha256"]

    _prepare(str(ROOT / "docs" / "architecture.md"), data)  # another corpus, same path
    job["train"]["steps"] = 4
    proc = _run(job, tmp_path, run)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"python -m hpctrain.runtime: train.data: {data} changed since this run trained on it (")
    assert [e for e in events(str(run)) if e["event"] == "failed"][-1]["exit_code"] == 2
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2  # not one step on the other data
