"""Token files checked against their sidecars: the runtime stops before any process group starts
(exit 2, one line). `submit` / `sweep`: tests/launch/test_data_refusal.py."""

from __future__ import annotations

import json
import os

import pytest

from hpctrain.config import job_from_dict
from hpctrain.config.data_files import data_problems, eval_file
from hpctrain.data.prepare import prepare

from ._entry import make_job, run_module, text_files
from ._entry import write_job as write_runtime_job


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """Byte-level tokens (vocab 256, uint16) with a validation file."""
    out = str(tmp_path_factory.mktemp("tok") / "tokens.bin")
    prepare(text_files()[:4], out, val_fraction=0.3)
    return out


def _job(tokens: str, **train) -> object:
    data = make_job(train={"data": tokens, **train})
    return job_from_dict(data)


def test_matching_files_pass_and_the_validation_file_is_found(tokens) -> None:
    job = _job(tokens, eval_every=2)
    assert data_problems(job) == []
    assert eval_file(job.train) == os.path.join(os.path.dirname(tokens), "tokens.val.bin")


@pytest.mark.parametrize("train, model, needle", [
    ({"data_dtype": "uint32"}, {}, "train.data_dtype: got uint32 but"),
    ({}, {"vocab": 128}, "model.vocab: got 128 but"),
    ({"data": "/nonexistent/tokens.bin"}, {}, "train.data: no such file (got '/nonexistent/tokens.bin')"),
    ({"eval_every": 5, "eval_data": "/nonexistent/val.bin"}, {}, "train.eval_data: no such file"),
])
def test_each_mismatch_is_one_line(tokens, train, model, needle) -> None:
    data = make_job(train={"data": tokens, **train})
    data["model"].update(model)
    problems = data_problems(job_from_dict(data))
    assert len(problems) == 1 and needle in problems[0], problems


def test_a_changed_file_and_eval_without_validation(tokens, tmp_path) -> None:
    copy = tmp_path / "t.bin"
    copy.write_bytes(open(tokens, "rb").read()[:-2])
    sidecar = json.loads(open(tokens + ".json").read())
    del sidecar["validation"]
    (tmp_path / "t.bin.json").write_text(json.dumps(sidecar))
    assert "the file changed since it was prepared" in data_problems(_job(str(copy)))[0]
    (tmp_path / "u.bin").write_bytes(open(tokens, "rb").read())
    (tmp_path / "u.bin.json").write_text(json.dumps(sidecar))
    assert "there is no validation file" in data_problems(_job(str(tmp_path / "u.bin"), eval_every=1))[0]


def test_runtime_exits_2_before_any_process_group(tokens, tmp_path) -> None:
    data = make_job(train={"data": tokens})
    data["model"]["vocab"] = 128
    job = write_runtime_job(data, str(tmp_path / "job.yaml"))
    proc = run_module(["--job", job, "--run-dir", str(tmp_path / "run")])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.vocab: got 128" in lines[0], proc.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing started
