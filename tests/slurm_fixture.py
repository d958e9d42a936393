"""The session-scoped `slurm_cluster` fixture: one real local Slurm for the whole test run.

Load it from tests/conftest.py with `pytest_plugins = ["slurm_fixture"]`. Tests that use it should
be marked `@pytest.mark.slurm` (registered here), so `pytest -m "not slurm"` skips them.

Without root or the Slurm packages the fixture skips its tests with a hint, unless
HPCTRAIN_REQUIRE_SLURM=1 or CI is set, where it fails instead: CI must not pass by skipping.
The daemons are stopped at the end of the session whatever happened in the tests (and at
interpreter exit as a last resort); their logs stay in `<cluster folder>/log/` under the pytest
temp folder, for post-mortems.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

try:  # tests/ is on sys.path under pytest's default import mode
    from slurm_cluster import _SOCKET_PATH_MAX, SlurmCluster, missing_binaries
except ModuleNotFoundError:  # imported as tests.slurm_fixture
    from tests.slurm_cluster import (  # type: ignore[no-redef]
        _SOCKET_PATH_MAX,
        SlurmCluster,
        missing_binaries,
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slurm: needs the real local Slurm test cluster (tests/slurm_fixture.py)")


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm test cluster needs root (SlurmUser=root, munged, slurmd)"
    missing = missing_binaries()
    if missing:
        return f"missing {', '.join(missing)}; run scripts/install-test-deps"
    return None


def _cluster_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder for the cluster, short enough for its unix socket paths."""
    folder = tmp_path_factory.mktemp("slurm")
    if len(str(folder / "run" / "munge.socket")) > _SOCKET_PATH_MAX:
        folder = Path(tempfile.mkdtemp(prefix="hpct-slurm-"))
    return folder


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A started SlurmCluster (2 nodes × 4 CPUs × 4 fake GPUs, partitions low/high, sacct).

    Clients need `cluster.env` (SLURM_CONF, PATH) in their environment, e.g.
    `monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])` or `subprocess.run(...,
    env=cluster.client_env())`. Job ids restart at 1 with each session; use a fresh submitit
    folder per test.
    """
    reason = _unavailable_reason()
    if reason:
        if os.environ.get("HPCTRAIN_REQUIRE_SLURM") == "1" or os.environ.get("CI"):
            pytest.fail(f"Slurm tests required but cannot run: {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster(_cluster_folder(tmp_path_factory))
    atexit.register(cluster.stop)  # if the session dies before its teardown
    cluster.start(timeout_s=90)  # stops what it started if it fails
    try:
        yield cluster
    finally:
        cluster.stop()
        atexit.unregister(cluster.stop)
