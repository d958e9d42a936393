"""What the ranks see and run: in a container, the folders of train.data and checkpoint.dir are bound
(with the run directory); the ranks run runtime.python, else the interpreter hpctrain runs in (on the
host) or the image's python3, never whichever python3 the job's PATH finds."""

from __future__ import annotations

import copy
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from hpctrain.config import job_from_dict
from hpctrain.errors import RenderError
from hpctrain.render import render_script

from .hostile import BASE_JOB
from .stubs import make_stub_dir, run_script


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_stub_dir(tmp_path_factory.mktemp("stubs"))


def _job(**sections: Any) -> Any:
    data = copy.deepcopy(BASE_JOB)
    data.update(monitor={}, runtime={})
    data["slurm"]["setup"] = []
    data.update(sections)
    return job_from_dict(data)


def _binds(argv: list[str]) -> list[str]:
    return [arg[len("--bind="):] for arg in argv if arg.startswith("--bind=")]


def test_container_binds_data_and_checkpoint_folders(tmp_path: Path, bin_dir: Path) -> None:
    run_dir, data, ckpt = tmp_path / "run", tmp_path / "data" / "tokens.bin", tmp_path / "ckpt" / "job-1"
    run_dir.mkdir()
    job = _job(container={"image": "/images/x.sif", "binds": ["/opt/site"]},
               train={"global_batch": 8, "micro_batch": 2, "steps": 10, "data": str(data)},
               checkpoint={"dir": str(ckpt)})
    run = run_script(render_script(job, run_dir=str(run_dir)), bin_dir=bin_dir, work=tmp_path)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    [argv] = run.argv_of("singularity")
    assert _binds(argv) == ["/opt/site", str(run_dir), str(data.parent), str(ckpt)]
    # singularity refuses to bind a missing folder: the script made it on the host first
    assert ckpt.is_dir()
    assert run.argv_of("python3")  # the image's python3 (here the stub on PATH) ran the rank


def test_folders_under_a_bind_are_not_bound_twice() -> None:
    job = _job(container={"image": "/images/x.sif", "binds": ["/lustre:/lustre:ro", "/scratch"]},
               train={"global_batch": 8, "micro_batch": 2, "steps": 10, "data": "/lustre/pile/tokens.bin"},
               checkpoint={"dir": "/scratch/ckpt"})
    script = render_script(job, run_dir="/scratch/runs/x")
    assert [line.strip() for line in script.splitlines() if line.strip().startswith("--bind=")] == \
        ["--bind=/lustre:/lustre:ro", "--bind=/scratch"]


def test_no_container_binds_nothing_and_makes_no_checkpoint_folder() -> None:
    script = render_script(_job(checkpoint={"dir": "/ckpt/a"}), run_dir="/runs/x")
    assert "--bind" not in script and "mkdir -p -- /ckpt/a" not in script


def test_checkpoint_folder_a_bind_cannot_carry_is_refused() -> None:
    job = _job(container={"image": "/images/x.sif"}, checkpoint={"dir": "/ckpt/a,b"})
    with pytest.raises(RenderError, match=r"^checkpoint\.dir: its folder must be bound into the container.*"
                                          r"'/ckpt/a,b'.*add a parent folder to container\.binds"):
        render_script(job, run_dir="/runs/x")


def _rank_line(script: str) -> str:
    [line] = [line.strip() for line in script.splitlines() if "-m hpctrain.runtime --job=" in line]
    return line


def test_host_ranks_run_the_interpreter_hpctrain_runs_in() -> None:
    script = render_script(_job(), run_dir="/runs/x")
    assert _rank_line(script).startswith(f"{shlex.quote(sys.executable)} -m hpctrain.runtime ")


def test_runtime_python_wins_on_the_host_and_in_a_container() -> None:
    for container in ({}, {"image": "/images/x.sif"}):
        job = _job(container=container, runtime={"python": "/opt/my env/bin/python"})
        assert _rank_line(render_script(job, run_dir="/runs/x")).startswith(
            "'/opt/my env/bin/python' -m hpctrain.runtime ")


def test_container_ranks_default_to_the_image_python3() -> None:
    script = render_script(_job(container={"image": "/images/x.sif"}), run_dir="/runs/x")
    assert _rank_line(script).startswith("python3 -m hpctrain.runtime ")


def test_an_entrypoint_job_runs_its_wrapper_in_the_image_with_the_script_folder_bound(tmp_path: Path,
                                                                                      bin_dir: Path) -> None:
    """Issue 28: the rank command of an entrypoint job is the wrapper (launch/entrypoint.py), and the folder of
    entrypoint.script is bound into the image, or the program would not be found there."""
    run_dir, script = tmp_path / "run", tmp_path / "code" / "train.py"
    run_dir.mkdir()
    data = copy.deepcopy(BASE_JOB)
    data.pop("model")
    data.update(monitor={}, runtime={}, container={"image": "/images/x.sif"},
                entrypoint={"script": str(script), "args": ["--dp", "{dp}"]})
    data["slurm"]["setup"] = []
    job = job_from_dict(data)
    run = run_script(render_script(job, run_dir=str(run_dir)), bin_dir=bin_dir, work=tmp_path)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    [argv] = run.argv_of("singularity")
    assert _binds(argv) == [str(run_dir), str(script.parent)]
    assert argv[argv.index("python3"):argv.index("python3") + 3] == ["python3", "-m", "hpctrain.launch.entrypoint"]
