"""A rank without pipelining does not import torch.distributed.pipelining (and the torch._dynamo it pulls in:
~0.6 s of each rank's start on this 2-core machine, measured with -X importtime); a pipelined one still builds
its schedule (tests/runtime/test_pipeline*.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")


def test_the_runtime_modules_import_no_pipelining_until_a_pipeline_is_built() -> None:
    code = ("import sys\n"
            "import hpctrain.runtime.trainer, hpctrain.runtime.parallel.build, hpctrain.runtime.training\n"
            "import hpctrain.runtime.checkpoint.checkpointer\n"
            "print('torch.distributed.pipelining' in sys.modules, 'torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr


def test_the_schedule_names_are_the_schedules_built() -> None:
    from hpctrain.plan.space import SCHEDULES_PP
    from hpctrain.runtime.parallel.pipeline import SCHEDULE_NAMES
    from hpctrain.runtime.parallel.pipeline_stage import SCHEDULES

    assert set(SCHEDULE_NAMES) == set(SCHEDULES) == set(SCHEDULES_PP)
