"""Issue 29 item 1: a job whose cluster.gpu names a GPU never trains on the CPU without being told to.

Before, `runtime/distributed.py` picked gloo on the CPU whenever CUDA was missing: a CPU torch wheel or a
wrong CUDA_VISIBLE_DEVICES gave a job ~1000x slower that nobody was told about. The reasons are a pure
function (table-tested); the whole runtime is run once on this CPU-only machine (torch here is a CPU
build, so the GPU job must stop with exit 2 before any step).
"""

from __future__ import annotations

import json

import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime.distributed import check_device, no_cuda_reason

from ._entry import events, make_job, run_module, write_job


@pytest.mark.parametrize("cuda, count, environ, want", [
    (None, 0, {}, "CPU-only build (torch.version.cuda is None)"),
    ("12.4", 0, {"CUDA_VISIBLE_DEVICES": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
    ("12.4", 0, {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
    ("12.4", 0, {"CUDA_VISIBLE_DEVICES": "0,1"}, "sees no CUDA device (CUDA_VISIBLE_DEVICES='0,1')"),
    ("12.4", 0, {}, "sees no CUDA device (CUDA_VISIBLE_DEVICES is unset)"),
    ("12.4", 2, {"CUDA_VISIBLE_DEVICES": "0,1"}, None),
])
def test_why_a_process_has_no_cuda_device(cuda, count, environ, want) -> None:
    reason = no_cuda_reason(cuda, count, environ)
    assert reason == want if want is None else want in reason


def test_a_gpu_job_without_a_device_is_refused_unless_told() -> None:
    with pytest.raises(ConfigError) as caught:
        check_device("h100-80gb", False, None, 0, {})
    message = str(caught.value)
    assert message.startswith("cluster.gpu: 'h100-80gb' but this rank has no usable CUDA device: this torch is a "
                              "CPU-only build")
    assert "cluster.gpu: cpu or runtime.allow_cpu: true" in message
    check_device("cpu", False, None, 0, {})  # a CPU job
    check_device("h100-80gb", True, None, 0, {})  # runtime.allow_cpu: on purpose
    check_device("h100-80gb", False, "12.4", 1, {})  # a GPU is there


def test_gpu_job_on_this_cpu_machine_exits_2_before_any_step(tmp_path) -> None:
    run = tmp_path / "run"
    job = make_job(train={"steps": 2}, cluster={"gpu": "h100-80gb"})
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", str(run)])
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "python -m hpctrain.runtime: cluster.gpu: 'h100-80gb' but this rank has no usable CUDA device" in proc.stderr
    assert not (run / "metrics.jsonl").exists()  # not one step
    [failed] = [e for e in events(str(run)) if e["event"] == "failed"]
    assert failed["exit_code"] == 2 and "no usable CUDA device" in failed["reason"]
    assert not [e for e in events(str(run)) if e["event"] == "started"]

    # Told to: it trains, and the started event says on what and with which torch.
    job["runtime"] = {"allow_cpu": True}
    proc = run_module(["--job", write_job(job, str(tmp_path / "job.yaml")), "--run-dir", str(run)])
    assert proc.returncode == 0, proc.stderr
    [started] = [e for e in events(str(run)) if e["event"] == "started"]
    import torch

    assert started["device"] == "cpu" and started["gpu"] == "h100-80gb"
    assert started["torch"] == str(torch.__version__) and started["cuda"] == torch.version.cuda
    assert started["layout"]["dp"] == 1 and started["layout"]["tp"] == 1
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    json.dumps(started)
