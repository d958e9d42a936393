"""Issue 30 Why 8: inputs that gave a traceback instead of one line.

- `runs_dir` on a place nothing can be created in (/sys: "Operation not permitted" even for root, the way
  a read-only mount refuses): `submit`, `submit --dry-run` and `sweep` exit 2 with one line;
- a `layout_changed` event whose `old`/`new` are not objects (a hand edit, a damaged disk): `status`,
  `doctor` and `report` read it as an unrecorded layout instead of raising AttributeError.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.cli.main import main

JOB = ("name: x\nmodel:\n  preset: tiny\ntrain:\n  steps: 1\n  global_batch: 1\ncluster:\n  executor: local\n"
       "  gpus_per_node: 1\nruns_dir: {runs}\n")


@pytest.mark.parametrize("command", [["submit"], ["submit", "--dry-run"], ["sweep", "--grid", "train.seed=1,2"],
                                     ["sweep", "--dry-run", "--grid", "train.seed=1,2"]])
def test_runs_dir_nothing_can_be_created_in_is_one_line(tmp_path, capsys, command) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(runs="/sys"))
    assert main([*command, str(job)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("runs_dir: cannot create a run folder in '/sys' ("), lines
    assert lines[0].endswith("; set runs_dir to a writable folder"), lines


def test_layout_changed_with_non_object_fields_is_read(tmp_path, capsys) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(runs=tmp_path / "runs"))
    assert main(["submit", "--dry-run", str(job)]) == 0
    capsys.readouterr()
    (run,) = (tmp_path / "runs").iterdir()
    with open(run / "events.jsonl", "a") as handle:
        handle.write(json.dumps({"time": 1.0, "event": "layout_changed", "attempt": 1, "old": "abc",
                                 "new": [1, 2]}) + "\n")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "submitted: (not recorded)" in out and "attempt 1: (not recorded)" in out, out
    assert main(["doctor", str(run), "--no-scheduler"]) == 0
    assert "layout changed at attempt 1: (not recorded) -> (not recorded)" in capsys.readouterr().out
    assert main(["report", str(run), "-o", str(tmp_path / "report")]) == 0
    capsys.readouterr()
