"""Issue 30 finding 3 and Why 10: symbolic links planted in a run directory.

Writers: a link at a temporary's name or at the file's own name must not carry a write out of the run
(the file it names stays as it was; the run's file ends a regular file). Readers that show what they
find (`logs`, `doctor`, `report`) refuse a file that a link takes out of the run, in one line (exit 2).
Real files and links in a temporary folder; the CLI in-process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from hpctrain.cli import main as cli_main
from hpctrain.errors import ConfigError
from hpctrain.rundir.events import append_event
from hpctrain.rundir.layout import write_text
from hpctrain.rundir.metrics import truncate_metrics

SECRET = "outside: must stay as it is\n"


def _outside(tmp_path: Path, name: str = "secret.txt") -> Path:
    target = tmp_path / "elsewhere" / name
    target.parent.mkdir(exist_ok=True)
    target.write_text(SECRET)
    return target


def test_truncate_metrics_neither_writes_through_its_temporary_nor_leaves_a_link(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = _outside(tmp_path)
    metrics = run / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3)))
    os.symlink(target, run / "metrics.jsonl.tmp")
    assert truncate_metrics(metrics, 2) == 2
    assert target.read_text() == SECRET
    assert not metrics.is_symlink() and metrics.is_file()
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    append_event(run, "x")  # later appends land in the run
    assert target.read_text() == SECRET


def test_a_link_at_the_name_is_replaced_or_refused_never_written_through(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    target = _outside(tmp_path)
    os.symlink(target, run / ".job.yaml.tmp")
    write_text(run / "job.yaml", "name: a\n")
    assert target.read_text() == SECRET and (run / "job.yaml").read_text() == "name: a\n"
    os.symlink(target, run / "plan.json")  # the atomic write replaces the link itself
    write_text(run / "plan.json", "{}\n")
    assert target.read_text() == SECRET and not (run / "plan.json").is_symlink()
    os.symlink(target, run / "events.jsonl")  # an append cannot replace: it refuses
    with pytest.raises(ConfigError, match=r"events\.jsonl: is a symbolic link; hpctrain writes only regular files"):
        append_event(run, "submitted")
    os.symlink(target, run / "metrics.jsonl")
    with pytest.raises(ConfigError, match=r"metrics\.jsonl: is a symbolic link"):
        truncate_metrics(run / "metrics.jsonl", 0)
    assert target.read_text() == SECRET


def _run_with_logs(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "linked-20260101-000000"
    for sub in ("submit", "logs", "ranks"):
        (run / sub).mkdir(parents=True)
    job = {"name": "linked", "model": {"preset": "tiny"}, "cluster": {"executor": "local", "gpu": "cpu"}}
    (run / "job.yaml").write_text(yaml.safe_dump(job))
    (run / "events.jsonl").write_text(json.dumps({"time": "2026-01-01T00:00:00.000+00:00", "event": "started",
                                                  "attempt": 0}) + "\n")
    (run / "logs" / "rank-0.attempt-0.log").write_text("rank 0 trained\n")
    return run


def test_logs_doctor_and_report_refuse_a_log_linked_out_of_the_run(tmp_path: Path, capsys) -> None:
    run = _run_with_logs(tmp_path)
    target = _outside(tmp_path, "shadow")
    os.symlink(target, run / "logs" / "rank-1.attempt-0.log")
    for argv in (["logs", str(run), "--rank", "1"], ["doctor", str(run), "--no-scheduler"],
                 ["report", str(run), "--no-plots"]):
        assert cli_main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert "outside" not in out, argv  # nothing of the target was shown
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].endswith(f"is a symbolic link to {target}, outside the run directory; "
                                                     "hpctrain shows only files inside it (remove the link)"), argv
    os.unlink(run / "logs" / "rank-1.attempt-0.log")
    os.symlink(run / "logs" / "rank-0.attempt-0.log", run / "logs" / "rank-1.attempt-0.log")  # inside: fine
    assert cli_main(["logs", str(run), "--rank", "1"]) == 0
    assert capsys.readouterr().out == "rank 0 trained\n"
