"""Shared test set-up: the real local Slurm cluster fixture (tests/slurm_fixture.py) for every test module,
and the `heavy` marker of the fast tier.

Use the cluster by naming the `slurm_cluster` fixture; do not re-declare pytest_plugins in test modules.

`scripts/test --fast` runs `-m "not slow and not slurm and not dist and not heavy"`: the unit tests, in a
few minutes. A module listed in HEAVY_MODULES starts whole runs (local supervisors, Ray, many ranks,
fresh venvs); each of its tests gets the `heavy` marker here, by the module's file name, so that the
list stays true when a test file moves. The full suite (what CI runs) runs everything.
"""

from __future__ import annotations

import os

import pytest

pytest_plugins = ["slurm_fixture"]

HEAVY_MODULES = frozenset({
    "test_chaos.py", "test_volcano_pods.py", "test_lifecycle.py", "test_ray.py", "test_launch.py",
    "test_operator.py", "test_interpreter.py", "test_elastic_slurm.py", "test_real_slurm.py",
    "test_rank_logs.py", "test_checkpoint.py", "test_checkpoint_hardening.py", "test_checkpoint_finalize.py",
    "test_trackers.py", "test_entrypoint.py", "test_lora.py", "test_lora_export.py", "test_hf_export.py",
    "test_hf_weights.py", "test_trainer.py", "test_scale_dry_build.py", "test_parallel_parity.py",
    "test_fsdp_pipeline.py", "test_pipeline_memory.py", "test_memory_truth.py", "test_activation_memory.py",
    "test_packaging.py", "test_recipe_checkout.py", "test_real_runs.py", "test_evaluate.py",
    "test_data_refusal.py", "test_requeue.py", "test_step_sync.py", "test_compile.py", "test_injection.py",
    "test_planner_accuracy_bench.py", "test_read_errors.py", "test_init.py", "test_follow.py",
    "test_hardening.py", "test_attempts.py", "test_start_checks.py", "test_ray_head_loss.py",
    "test_kill9.py", "test_context_parallel.py", "test_cp_memory.py", "test_fp8.py",
    "test_host_embedding_attention.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if os.path.basename(str(item.path)) in HEAVY_MODULES:
            item.add_marker(pytest.mark.heavy)
