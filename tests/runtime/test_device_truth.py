"""Issue 29 item 1: a job whose cluster.gpu names a GPU never trains on the CPU without being told to.

Before, `runtime/distributed.py` picked gloo on the CPU whenever CUDA was missing: a CPU torch wheel or a
wrong CUDA_VISIBLE_DEVICES gave a job ~1000x slower that nobody was told about. The reasons are a pure
function (table-tested); the whole runtime runs in test_start_checks.py.
"""

from __future__ import annotations

import pytest

from hpctrain.errors import ConfigError
from hpctrain.runtime.distributed import check_device, no_cuda_reason


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
