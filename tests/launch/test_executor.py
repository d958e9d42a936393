"""The one Executor interface: every registered backend implements it, and `choose` picks as documented."""

from __future__ import annotations

import inspect
import os
import stat
from pathlib import Path
from typing import Any, Optional

import pytest

from hpctrain.config import Job, job_from_dict, load_job
from hpctrain.errors import ConfigError
from hpctrain.launch.executor import REGISTRY, Executor, choose, executor_class, executor_named

from ._helpers import REPO, tiny_job

METHODS = ("describe", "check", "check_sweep", "prepare", "submit", "state", "cancel", "logs")


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_backend_is_an_executor_with_every_method(name: str) -> None:
    cls = executor_class(name)
    assert issubclass(cls, Executor) and not inspect.isabstract(cls), cls
    assert cls.name == name and isinstance(cls.supports_arrays, bool)
    executor = executor_named(name, {"PATH": ""})
    assert isinstance(executor, Executor)
    for method in METHODS:
        assert callable(getattr(executor, method)), (name, method)
        # the same parameters as the interface (a backend may add keyword-only ones with defaults)
        base = inspect.signature(getattr(Executor, method)).parameters
        own = inspect.signature(getattr(cls, method)).parameters
        assert list(own)[:len(base)] == list(base), (name, method, list(own))


def test_the_four_backends_are_registered() -> None:
    assert set(REGISTRY) == {"local", "slurm", "ray", "volcano"}
    assert {n for n in REGISTRY if executor_class(n).supports_arrays} == {"local", "slurm"}


def test_an_unknown_executor_name_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown executor 'pbs'; registered: local, ray, slurm, volcano"):
        executor_class("pbs")


def _env_with_sbatch(tmp_path: Path, with_sbatch: bool) -> dict[str, str]:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    if with_sbatch:
        sbatch = folder / "sbatch"
        sbatch.write_text("#!/bin/sh\nexit 0\n")
        sbatch.chmod(sbatch.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": str(folder), "RAY_ADDRESS": "http://ray-head:8265"}


def _job(executor: str) -> Job:
    if executor == "volcano":
        return load_job(str(REPO / "examples" / "llama3-8b-volcano.yaml"))
    return job_from_dict(tiny_job("choose", executor=executor))


# cluster.executor, sbatch on PATH, dry run -> (the executor chosen, its note) or the error's words
CHOOSE_TABLE: list[tuple[str, bool, bool, Optional[str], str]] = [
    ("auto", True, False, "slurm", "executor: slurm (cluster.executor auto, sbatch found at {bin}/sbatch)"),
    ("auto", False, False, "local", "executor: local (cluster.executor auto, no sbatch on PATH)"),
    ("auto", False, True, "local", "executor: local (cluster.executor auto, no sbatch on PATH)"),
    ("slurm", True, False, "slurm", "executor: slurm (cluster.executor)"),
    ("slurm", False, True, "slurm", "executor: slurm (cluster.executor; dry run: no sbatch on PATH, none needed)"),
    ("slurm", False, False, None, "cluster.executor: slurm needs `sbatch` but it is not on PATH"),
    ("local", True, False, "local", "executor: local (cluster.executor)"),
    ("ray", False, False, "ray", "executor: ray (cluster.executor; Ray Jobs API at http://ray-head:8265)"),
    ("volcano", False, False, "volcano", "executor: volcano (cluster.executor)"),
]


@pytest.mark.parametrize(("kind", "sbatch", "dry_run", "chosen", "words"), CHOOSE_TABLE)
def test_choose(tmp_path: Path, kind: str, sbatch: bool, dry_run: bool, chosen: Optional[str], words: str) -> None:
    env = _env_with_sbatch(tmp_path, sbatch)
    words = words.format(bin=tmp_path / "bin")
    if chosen is None:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            choose(_job(kind), env, dry_run=dry_run)
        return
    executor, note = choose(_job(kind), env, dry_run=dry_run)
    assert (executor.name, note) == (chosen, words)
    assert executor.env == env


# what each backend refuses: (executor, job sections, array) -> the error's words, or None
CHECK_TABLE: list[tuple[str, dict[str, Any], Optional[str], Optional[str]]] = [
    ("local", {"container": {"image": "/img.sif"}}, None, "the local executor runs on the host, not in an image"),
    ("ray", {"container": {"image": "/img.sif"}}, None, "the ray executor runs the ranks in the Ray workers'"),
    ("ray", {}, "0-1%1", "cluster.executor: ray submits one job; a sweep (job array) needs"),
    ("slurm", {"container": {"image": "/img.sif"}}, "0-1%1", None),
    ("local", {}, "0-3%2", None),
]


@pytest.mark.parametrize(("kind", "sections", "array", "words"), CHECK_TABLE)
def test_check(kind: str, sections: dict[str, Any], array: Optional[str], words: Optional[str]) -> None:
    job = job_from_dict(tiny_job("check", executor=kind, **sections))
    executor = executor_named(kind)
    if words is None:
        executor.check(job, array=array)
        return
    with pytest.raises(ConfigError) as caught:
        executor.check(job, array=array)
    assert words in str(caught.value)


def test_volcano_refuses_an_array() -> None:
    with pytest.raises(ConfigError, match="cluster.executor: volcano submits one Job; a sweep"):
        executor_named("volcano").check(_job("volcano"), array="0-1%1")
