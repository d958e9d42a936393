"""Issue 29: one run's history as a new user makes it on the local executor, told the same by every reader.

cancel + resume + crash (`kill -9` of a rank) + resume with another layout. Before, every metrics line
and runtime event said `attempt: 0` while the logs were named attempt-1, attempt-2 and the `ended`
events counted; `status` and `report` showed `restarts 0` and the plot had no marker. The same run then
checks what the doctor says after the kill (no out-of-memory story without an OOM in the logs) and that
a token file re-prepared in place stops `resume` (exit 2, one line, nothing submitted).
One run, the tiny preset, 12 steps: the real CLI, supervisor and runtime.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import matplotlib.axes

from hpctrain.diagnose.report import summarize, write_report

from ._helpers import REPO, log_tail, probe_env, run_cli, run_dir_of, status_json, tiny_job, wait_status, write_job

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "STOPPED"}
STEPS = 12


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = os.path.dirname(sys.executable)  # no Slurm client: executor auto -> local
    return {**env, **extra}


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cli_ok(args: list[str], cwd: Path, env: dict[str, str]) -> None:
    result = run_cli(args, cwd=cwd, env=env, timeout_s=90)
    assert result.returncode == 0, f"hpctrain {' '.join(args)}:\n{result.stdout}\n{result.stderr}"


def _prepare(tmp_path: Path, env: dict[str, str], source: Path, out: Path) -> None:
    _cli_ok(["data", "prepare", str(source), "-o", str(out)], tmp_path, env)


def _ended(run_dir: Path, env: dict[str, str], what: str) -> dict[str, Any]:
    return wait_status(run_dir, env, lambda s: s["state"] in TERMINAL, 150, what)


def test_cancel_resume_crash_resume_keeps_one_attempt_count(tmp_path: Path) -> None:
    probe, probes = probe_env(tmp_path)
    env = _env(HPCTRAIN_TEST_STEP_DELAY_S="0.3", **probe)
    data = tmp_path / "d2.bin"
    _prepare(tmp_path, env, REPO / "README.md", data)
    job = tiny_job("history", executor="local", gpus_per_node=1, steps=STEPS, checkpoint={"every_steps": 2},
                   train={"data": str(data)})
    submitted = run_cli(["submit", str(write_job(tmp_path, job))], cwd=tmp_path, env=env, timeout_s=60)
    assert submitted.returncode == 0, submitted.stderr
    run_dir = run_dir_of(submitted)

    # attempt 0: cancelled after a few steps
    wait_status(run_dir, env, lambda s: (s["step"] or 0) >= 3, 120, "step 3")
    _cli_ok(["cancel", str(run_dir)], tmp_path, env)
    assert _ended(run_dir, env, "the cancel")["state"] == "CANCELLED", log_tail(run_dir)

    # attempt 1: resumed, then one rank killed with SIGKILL. Its steps are slower: the kill must land before its last
    # step, after the two status polls below (seconds each on a loaded machine: in CI attempt 1 once finished its
    # 8 steps of 0.3 s first, and the rank was gone, ProcessLookupError).
    seen = set(probes.glob("*.json"))
    _cli_ok(["resume", str(run_dir)], tmp_path, {**env, "HPCTRAIN_TEST_STEP_DELAY_S": "1.5"})
    first_resumed = _lines(run_dir / "metrics.jsonl")[-1]["step"] if (run_dir / "metrics.jsonl").exists() else 0
    wait_status(run_dir, env, lambda s: (s["step"] or 0) >= first_resumed + 2, 120, "two steps of attempt 1")
    # ... and until attempt 1 has saved a checkpoint: killed before that, attempt 2 resumes from attempt 0's and
    # re-runs (and re-logs) attempt 1's steps, which leaves attempt 1 no metrics line (a race seen in CI).
    wait_status(run_dir, env, lambda s: any(e["event"] == "checkpoint saved" and e.get("attempt") == 1
                                            for e in _lines(run_dir / "events.jsonl")), 120, "attempt 1's checkpoint")
    [rank] = [int(p.stem) for p in set(probes.glob("*.json")) - seen]
    os.kill(rank, signal.SIGKILL)
    assert _ended(run_dir, env, "the killed rank")["state"] == "FAILED", log_tail(run_dir)
    doctor = run_cli(["doctor", str(run_dir), "--json", "--no-scheduler"], cwd=tmp_path, env=env, timeout_s=60)
    families = {f["family"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert "oom" not in families, doctor.stdout  # no OOM message anywhere: no OOM story
    assert "killed" in families and "signal 9" in families["killed"]["title"], doctor.stdout

    # attempt 2: resumed on two ranks (dp 1 -> 2), to the end
    _cli_ok(["resume", str(run_dir), "--set", "cluster.gpus_per_node=2"], tmp_path, env)
    status = _ended(run_dir, env, "the resumed run")
    assert (status["state"], status["step"]) == ("COMPLETED", STEPS), log_tail(run_dir)

    # One attempt count everywhere: status, metrics, runtime and launcher events, log names.
    assert status_json(run_dir, env)["restarts"] == 2
    metrics = _lines(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    attempts = [m["attempt"] for m in metrics]
    assert attempts == sorted(attempts) and set(attempts) == {0, 1, 2}, attempts
    events = _lines(run_dir / "events.jsonl")
    assert [e["attempt"] for e in events if e["event"] == "started"] == [0, 1, 2]
    assert [e["attempt"] for e in events if e["event"] == "ended"] == [0, 1, 2]
    runtime_attempts = {e["attempt"] for e in events if e["event"] in ("checkpoint_saved", "finished")}
    assert runtime_attempts <= {0, 1, 2} and 2 in runtime_attempts
    assert {p.name for p in (run_dir / "logs").glob("rank-0.attempt-*.log")} == {
        f"rank-0.attempt-{a}.log" for a in (0, 1, 2)}

    # The report: restarts 2 in the table, both markers on the training plot (read through matplotlib's calls).
    first_step = {a: next(m["step"] for m in metrics if m["attempt"] == a) for a in (1, 2)}
    summary = summarize(run_dir)
    assert summary.restarts == [(first_step[1], 1), (first_step[2], 2)]
    assert [(s, a) for s, a, _ in summary.layout_changes] == [(first_step[2], 2)]
    assert "dp=1" in summary.layout_changes[0][2] and "dp=2" in summary.layout_changes[0][2]
    drawn: list[tuple[float, Any]] = []
    real_axvline = matplotlib.axes.Axes.axvline

    def axvline(self: Any, x: float = 0, *args: Any, **kwargs: Any) -> Any:
        drawn.append((x, kwargs.get("label")))
        return real_axvline(self, x, *args, **kwargs)

    matplotlib.axes.Axes.axvline = axvline  # a spy: the real call draws, the list keeps what was drawn
    try:
        text, files = write_report(run_dir, tmp_path / "report")
    finally:
        matplotlib.axes.Axes.axvline = real_axvline
    assert (tmp_path / "report" / "training.png").is_file()
    assert (first_step[1], "restart (resumed from a checkpoint)") in drawn
    assert (first_step[2], "layout changed") in drawn
    rows = {line.split("  ")[0]: line for line in text.splitlines()}
    assert rows["restarts"].split()[-1] == "2", text
    assert "layout changed (attempt 2)" in rows, text

    # The data the run trained on, re-prepared in place from another text: resume stops, nothing submitted.
    _prepare(tmp_path, env, REPO / "docs" / "architecture.md", data)
    before = (run_dir / "events.jsonl").read_text()
    again = run_cli(["resume", str(run_dir), "--set", f"train.steps={STEPS + 4}"], cwd=tmp_path, env=env,
                    timeout_s=60)
    assert again.returncode == 2, again.stdout + again.stderr
    [line] = again.stderr.strip().splitlines()
    assert line.startswith(f"train.data: {data} changed since this run trained on it (") and "Traceback" not in line
    assert (run_dir / "events.jsonl").read_text() == before
