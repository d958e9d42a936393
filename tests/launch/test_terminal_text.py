"""Issue 30, Why 10: text read from a run directory reaches the terminal through one sanitiser.

A run directory whose reason, log line, host name and job id carry terminal escapes (colour, clear
screen, an OSC window title, a bidi override): `status`, `doctor`, `report`, `cancel` and the notes of
`logs` print them as visible escapes, never as the raw bytes a terminal would interpret. Real files;
the CLI in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hpctrain.cli import main as cli_main

HOSTILE = "\x1b[31mred\x1b[0m \x1b]0;owned\x07 \x1b[2J \u202eevil \x9b1m"
RAW = ("\x1b", "\x07", "\u202e", "\x9b")


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "escapes-20260101-000000"
    for sub in ("submit", "logs", "ranks"):
        (run / sub).mkdir(parents=True)
    job = {"name": "escapes", "model": {"preset": "tiny"}, "train": {"steps": 3},
           "cluster": {"executor": "local", "gpu": "cpu"}}
    (run / "job.yaml").write_text(yaml.safe_dump(job))
    events = [{"time": "2026-01-01T00:00:00.000+00:00", "event": "submitted", "executor": "local",
               "job_id": "local-1" + HOSTILE},
              {"time": "2026-01-01T00:00:01.000+00:00", "event": "started", "attempt": 0},
              {"time": "2026-01-01T00:00:09.000+00:00", "event": "failed", "attempt": 0, "step": 2,
               "reason": "rank 0: " + HOSTILE}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "submit" / "local.json").write_text(json.dumps({"state": "FAILED", "reason": "exit 1 " + HOSTILE,
                                                          "exit_codes": [1]}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 2, "loss": 5.0, "tokens_per_s": 10.0}) + "\n")
    (run / "ranks" / "rank-0.json").write_text(json.dumps({"rank": 0, "world_size": 1, "host": "node" + HOSTILE,
                                                           "steps_timed": 1, "step_time_s": 0.1}))
    (run / "logs" / "rank-0.attempt-0.log").write_text(
        f"[rank0]: Watchdog caught collective operation timeout: {HOSTILE}\n")
    return run


def test_printable_writes_escapes_visibly_and_keeps_lines() -> None:
    from hpctrain.rundir.terminal import printable

    assert printable("a\tb\nc") == "a\tb\nc"
    assert printable(HOSTILE) == r"\x1b[31mred\x1b[0m \x1b]0;owned\x07 \x1b[2J \u202eevil \x9b1m"


def test_status_doctor_report_cancel_and_logs_print_no_raw_escape(tmp_path: Path, capsys) -> None:
    run = _run(tmp_path)
    commands = {
        "status": (["status", str(run)], "exit 1 \\x1b[31mred"),
        "status list": (["status", "--runs-dir", str(run.parent)], "escapes-20260101-000000"),
        "doctor": (["doctor", str(run), "--no-scheduler"], "\\x1b[31mred"),
        "report": (["report", str(run), "--no-plots"], "node\\x1b[31mred"),
        "cancel": (["cancel", str(run)], "job local-1\\x1b[31mred"),
    }
    for what, (argv, shown) in commands.items():
        code = cli_main(argv)
        out, err = capsys.readouterr()
        assert code in (0, 1), (what, code, err)
        assert shown in out, (what, out)
        for raw in RAW:
            assert raw not in out + err, (what, repr(raw), out)
    (run / "logs" / f"rank-1.attempt-0{HOSTILE}.log").write_text("rank 1\n")
    assert cli_main(["logs", str(run)]) == 0
    out, _ = capsys.readouterr()
    headers = [line for line in out.splitlines() if line.startswith("==> ")]
    assert len(headers) == 2 and "rank-1.attempt-0\\x1b[31mred" in headers[1], headers
    assert not any(raw in "".join(headers) for raw in RAW), headers
    assert HOSTILE in out  # the log's own bytes are shown as they are, as `cat` would
