"""Relative paths in a job (issue 29 item 5): an input the job file names is read relative to the job
file's folder, a `--set` value relative to the current directory, runs_dir and checkpoint.dir relative
to the current directory; job.resolved.yaml records the absolute paths."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from hpctrain.config import load_job

from ._helpers import run_cli

TOPO = Path(__file__).parents[1] / "plan" / "data" / "topo"
HF_CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False,
             "rope_theta": 10000.0}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """proj/job.yaml naming data/, hf/, topo.txt and templates/ by relative paths; other/ is another folder."""
    proj = tmp_path / "proj"
    for folder in ("data", "hf", "templates"):
        (proj / folder).mkdir(parents=True)
    (proj / "data" / "t.bin").write_bytes(bytes(128))  # 64 uint16 tokens: seq_len 32 + 1 fit
    (proj / "data" / "v.bin").write_bytes(bytes(128))
    (proj / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    (proj / "hf" / "model.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")  # a valid, empty file
    shutil.copy(TOPO / "pcie-nvlink-pairs.txt", proj / "topo.txt")
    (tmp_path / "other").mkdir()
    job = {"name": "rel", "template_dir": "templates",
           "model": {"init_from": "hf", "seq_len": 32},
           "train": {"data": "data/t.bin", "eval_data": "./data/v.bin", "global_batch": 8, "steps": 2,
                     "precision": "fp32"},
           "parallel": {"tp": 1, "pp": 1},
           "cluster": {"executor": "local", "nodes": 1, "gpus_per_node": 8, "topology": {"nvidia_smi": "topo.txt"}},
           "runs_dir": "runs", "checkpoint": {"dir": "ck"}, "runtime": {"python": "venv/bin/python"}}
    (proj / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return tmp_path


@pytest.mark.parametrize("where", ["proj", "other", "."])
def test_inputs_resolve_against_the_job_file_from_any_directory(project: Path, monkeypatch, where: str) -> None:
    monkeypatch.chdir(project / where)
    job = load_job(os.path.relpath(project / "proj" / "job.yaml"))
    proj = project / "proj"
    assert job.train.data == str(proj / "data" / "t.bin") and job.train.eval_data == str(proj / "data" / "v.bin")
    assert job.model.init_from == str(proj / "hf") and job.model.hidden == 64  # config.json was read
    assert job.cluster.topology.nvidia_smi == str(proj / "topo.txt") and job.template_dir == str(proj / "templates")
    assert job.runtime.python == str(proj / "venv" / "bin" / "python")
    assert (job.runs_dir, job.checkpoint.dir) == ("runs", "ck")  # outputs: made absolute at submit, from here


def test_set_values_resolve_against_the_current_directory(project: Path, monkeypatch) -> None:
    monkeypatch.chdir(project / "other")
    (project / "other" / "mine.bin").write_bytes(bytes(64))
    job = load_job(str(project / "proj" / "job.yaml"), ["train.data=mine.bin"])
    assert job.train.data == str(project / "other" / "mine.bin")
    assert job.train.eval_data == str(project / "proj" / "data" / "v.bin")  # still the file's, not --set's
    whole = load_job(str(project / "proj" / "job.yaml"), ["train={data: x/y.bin, steps: 2}"])
    assert whole.train.data == str(project / "other" / "x" / "y.bin")  # a section set with --set: from here
    assert load_job(str(project / "proj" / "job.yaml"), ["train.data=synthetic"]).train.data == "synthetic"
    assert load_job(str(project / "proj" / "job.yaml"), ["runtime.python=python3"]).runtime.python == "python3"  # on PATH


def test_submit_from_two_directories_records_the_same_files(project: Path) -> None:
    """`submit --dry-run` from the job's folder and from another: job.resolved.yaml names the same inputs
    (absolute), and the runs land where the command ran; `plan` reads the topology file from either."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    resolved = []
    for cwd in (project / "proj", project / "other"):
        result = run_cli(["submit", str(project / "proj" / "job.yaml"), "--dry-run"], cwd=cwd, env=env, timeout_s=60)
        assert result.returncode == 0, result.stderr
        run_dir = Path([line for line in result.stdout.splitlines() if line.startswith("run ")][-1][4:])
        assert run_dir.parent == cwd / "runs"
        resolved.append(yaml.safe_load((run_dir / "job.resolved.yaml").read_text()))
        assert resolved[-1]["checkpoint"]["dir"] == str(cwd / "ck")
        plan = run_cli(["plan", os.path.relpath(project / "proj" / "job.yaml", cwd)], cwd=cwd, env=env, timeout_s=60)
        assert plan.returncode == 0, plan.stderr
    for key, name in (("data", "t.bin"), ("eval_data", "v.bin")):
        assert resolved[0]["train"][key] == resolved[1]["train"][key] == str(project / "proj" / "data" / name)
    assert resolved[0]["model"]["init_from"] == resolved[1]["model"]["init_from"] == str(project / "proj" / "hf")


def test_sweep_grid_paths_follow_the_same_rule(project: Path) -> None:
    """A grid over an input path: the job file's `sweep.grid` values from its folder, `--grid` values from
    the current directory; each task's job.resolved.yaml names the absolute file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)
    job = yaml.safe_load((project / "proj" / "job.yaml").read_text())
    job["sweep"] = {"grid": {"train.data": ["data/t.bin", "data/v.bin"]}}
    (project / "proj" / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    (project / "other" / "here.bin").write_bytes(bytes(128))
    result = run_cli(["sweep", str(project / "proj" / "job.yaml"), "--grid", "train.eval_data=here.bin", "--dry-run"],
                     cwd=project / "other", env=env, timeout_s=60)
    assert result.returncode == 0, result.stderr
    run_dir = Path([line for line in result.stdout.splitlines() if line.startswith("run ")][-1][4:])
    tasks = [yaml.safe_load((t / "job.resolved.yaml").read_text())["train"] for t in sorted((run_dir / "tasks").iterdir())]
    assert sorted(t["data"] for t in tasks) == [str(project / "proj" / "data" / n) for n in ("t.bin", "v.bin")]
    assert {t["eval_data"] for t in tasks} == {str(project / "other" / "here.bin")}
