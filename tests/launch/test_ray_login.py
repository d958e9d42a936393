"""The Ray executor without a Ray cluster: the login path never imports ray, and a Ray address where
nothing answers is a scheduler failure (exit 3, one line naming the address)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import REPO, run_cli, tiny_job, write_job


def test_login_path_imports_no_ray() -> None:
    code = ("import sys, hpctrain.cli, hpctrain.launch.submit, hpctrain.launch.status, hpctrain.launch.cancel, "
            "hpctrain.launch.resume, hpctrain.launch.ray.executor, hpctrain.cli.launch; "
            "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')); "
            "assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr


def test_dry_run_needs_no_ray_cluster(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ADDRESS": "http://127.0.0.1:9"}
    result = run_cli(["submit", str(write_job(tmp_path, tiny_job("dry", executor="ray"))), "--dry-run"],
                     cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "executor: ray (cluster.executor; Ray Jobs API at http://127.0.0.1:9)" in result.stderr


def test_unreachable_ray_address_exits_3(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    job = tiny_job("noray", executor="ray", cluster={"ray": {"address": "http://127.0.0.1:9"}})
    result = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 3, result
    lines = result.stderr.strip().splitlines()
    assert any("cluster.ray.address http://127.0.0.1:9: no Ray Jobs API answers there" in line for line in lines), lines
    assert "Traceback" not in result.stderr


def test_container_image_is_refused_for_ray(tmp_path: Path) -> None:
    job = tiny_job("img", executor="ray", container={"image": "/images/x.sif"})
    result = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 2 and "container.image: the ray executor runs the ranks" in result.stderr, result
