"""The restart section, and its old names under slurm: read as restart.*, with a one-line notice."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.config import job_from_dict, job_to_dict, load_job
from hpctrain.config.loader import _NOTICED

from tests.test_config_errors import GOOD


@pytest.fixture(autouse=True)
def fresh_notices() -> None:
    _NOTICED.clear()  # each notice is printed once per process


def test_restart_section_defaults_and_values(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD + "restart:\n  max_requeues: 5\n  signal: TERM\n")
    job = load_job(str(path))
    assert (job.restart.requeue, job.restart.max_requeues, job.restart.signal, job.restart.signal_seconds) == \
        (True, 5, "TERM", 120)


@pytest.mark.parametrize(("name", "value", "text"), [
    ("requeue", False, "false"), ("max_requeues", 5, "5"), ("signal", "HUP", "HUP"), ("signal_seconds", 300, "300"),
])
def test_old_slurm_names_still_work_with_a_notice(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str,
                                                  value: object, text: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD + f"slurm:\n  {name}: {text}\n")
    job = load_job(str(path))
    assert getattr(job.restart, name) == value and getattr(job.slurm, name) is None
    assert f"{name}" not in job_to_dict(job)["slurm"]  # job.resolved.yaml carries the new name only
    err = capsys.readouterr().err
    assert err == f"notice: slurm.{name} is now restart.{name} (read as restart.{name}={value})\n"


def test_old_and_new_name_agreeing_is_fine(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD + "slurm:\n  max_requeues: 5\nrestart:\n  max_requeues: 5\n")
    assert load_job(str(path)).restart.max_requeues == 5


def test_old_and_new_name_disagreeing_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD + "slurm:\n  max_requeues: 5\nrestart:\n  max_requeues: 3\n")
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if "disagree" in line]
    assert len(lines) == 1 and "t.yaml:" in lines[0], out
    assert "slurm.max_requeues=5 and restart.max_requeues=3" in lines[0] and "keep restart.max_requeues" in lines[0]
    assert "Traceback" not in out.err


def test_set_of_the_new_name_overrides_the_old_one_in_the_file() -> None:
    data = {"name": "x", "model": {"preset": "tiny"}, "cluster": {"executor": "local", "gpu": "cpu"},
            "slurm": {"max_requeues": 5}}
    assert job_from_dict(data, ["restart.max_requeues=7"]).restart.max_requeues == 7
    assert job_from_dict(data).restart.max_requeues == 5


def test_bad_old_name_value_is_placed_at_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD + "slurm:\n  signal: KILL\n")
    assert main(["validate", str(path)]) == 2
    out = capsys.readouterr()
    assert "slurm.signal" in out.out + out.err
