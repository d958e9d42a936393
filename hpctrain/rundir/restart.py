"""The restart policy: after an attempt ends, start it again (from the newest checkpoint) or not, and why.

One pure function, `decide`, read by every backend from the job's restart section:

- the batch script's exit path runs `python -m hpctrain.rundir.restart ...` after srun
  (sbatch_templates/exit_path.sh.j2) and acts on the answer: `scontrol requeue` and the events stay
  shell, on the host, where scontrol exists;
- the Ray driver (launch/ray/driver.py) calls `decide` between attempts;
- the runtime (runtime/requeue.py) calls `decide` when it requeues itself (no batch script).

The rules, in order: success without a restart request -> done; bad input (exit 2, or a rank's
bad-input marker) -> never (every attempt would fail the same way); a crash at the step where the
previous attempt crashed -> no (no progress); restart.requeue false -> no; restart.max_requeues used
-> no; else (the runtime asked after a signal, a preemption or a near time limit; or a crash) -> yes.
Torch-free, and imports nothing outside rundir and config: the exit path must start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from hpctrain.config.infra import RestartConfig
from hpctrain.rundir.events import WHY_NOT_REQUEUED
from hpctrain.rundir.layout import FAILED_STEP_FILE
from hpctrain.rundir.metrics import last_metrics
from hpctrain.rundir.safe_files import write_atomic

BAD_INPUT_EXIT = 2  # docs/architecture: exit 2 = the user's input is wrong
# What ended the attempt (an event's `reason`): the causes a restart is asked for, and the others.
FINISHED, RUNTIME_REQUESTED, RANK_CRASHED, BAD_INPUT = "finished", "runtime-requested", "rank-crashed", "bad-input"
NO_STEP: Literal["none"] = "none"  # a crash before the first metrics line: FailedStep for "no step logged"
FailedStep = Union[int, Literal["none"]]


@dataclass(frozen=True)
class Markers:
    """What the ranks left for the launcher (rundir/layout.py REQUEUE_MARKER, BAD_INPUT_MARKER): their text, or None."""

    requeue_requested: Optional[str] = None  # the runtime saved and asks for a restart: why (signal USR2 at step 7 ...)
    bad_input: Optional[str] = None  # a rank refused its input: what it said


@dataclass(frozen=True)
class Decision:
    """Restart or not. `reason`: why not (a WHY_NOT_REQUEUED key, or "finished"), or why yes (the cause);
    `cause`: what ended the attempt (finished, runtime-requested, rank-crashed, bad-input)."""

    requeue: bool
    reason: str
    cause: str

    @property
    def why_not(self) -> str:
        """The WHY_NOT_REQUEUED key of a refusal ("" for a restart or a finished run)."""
        return self.reason if self.reason in WHY_NOT_REQUEUED else ""


def step_key(step: Optional[int]) -> FailedStep:
    """How a crash's step is remembered: the step, or NO_STEP before the first metrics line."""
    return NO_STEP if step is None else step


def decide(exit_code: int, markers: Markers, step: Optional[int], last_failed_step: Optional[FailedStep],
           attempt: int, policy: RestartConfig) -> Decision:
    """The restart decision after an attempt.

    exit_code: the ranks' (srun's) status; step: the last step in metrics.jsonl (None: none yet);
    last_failed_step: where the previous attempt crashed (None: it did not); attempt: restarts so far
    (SLURM_RESTART_COUNT); policy: the job's restart section.
    """
    if markers.bad_input is not None or exit_code == BAD_INPUT_EXIT:
        return Decision(False, "bad-input", BAD_INPUT)
    if markers.requeue_requested is not None:
        cause = RUNTIME_REQUESTED
    elif exit_code != 0:
        cause = RANK_CRASHED
        if attempt > 0 and last_failed_step is not None and last_failed_step == step_key(step):
            return Decision(False, "same-step", cause)
    else:
        return Decision(False, FINISHED, FINISHED)
    if not policy.requeue:
        return Decision(False, "requeue-disabled", cause)
    if attempt >= policy.max_requeues:
        return Decision(False, "max-requeues-reached", cause)
    return Decision(True, cause, cause)


def exit_code_after(decision: Decision, exit_code: int) -> int:
    """What the job ends with when it is not restarted: 0 finished, 2 bad input, else the ranks' status
    (1 when they exited 0: the run stopped before its last step, which is a failure)."""
    if decision.cause == FINISHED:
        return 0
    if decision.cause == BAD_INPUT:
        return BAD_INPUT_EXIT
    return exit_code or 1


def message(decision: Decision, exit_code: int, step: Optional[int], attempt: int, policy: RestartConfig,
            markers: Markers, job_id: str) -> list[tuple[int, str]]:
    """The exit path's lines, (stream 1 or 2, text): what ended the attempt, then what happens."""
    lines: list[tuple[int, str]] = []
    where = NO_STEP if step is None else str(step)
    if decision.cause == BAD_INPUT:
        return [(2, f"hpctrain: not requeued: a rank exited 2 (bad input): {(markers.bad_input or '')[:500]}")]
    if decision.cause == FINISHED:
        return [(1, f"hpctrain: training finished (attempt {attempt})")]
    if decision.cause == RUNTIME_REQUESTED:
        lines.append((1, f"hpctrain: the runtime asked to be requeued: {(markers.requeue_requested or '')[:500]}"))
    else:
        lines.append((1, f"hpctrain: srun exited with status {exit_code}: a rank failed or was killed"))
    if decision.requeue:
        lines.append((1, f"hpctrain: requeueing {job_id} (restart {attempt + 1} of at most {policy.max_requeues}): "
                         f"{decision.cause}"))
    elif decision.reason == "same-step":
        lines.append((2, f"hpctrain: not requeued: failed again at step {where} after a requeue"))
    elif decision.reason == "requeue-disabled":
        lines.append((2, f"hpctrain: not requeued: restart.requeue is false ({decision.cause})"))
    else:
        lines.append((2, f"hpctrain: not requeued: {attempt} of restart.max_requeues={policy.max_requeues} "
                         f"requeues used ({decision.cause})"))
    return lines


# -- the batch script's exit path: `python -m hpctrain.rundir.restart` ------------------------------------
def read_marker(path: Optional[str]) -> Optional[str]:
    """A marker's text (None when the file is absent)."""
    if not path:
        return None
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"(unreadable: {exc.strerror})"


def read_failed_step(path: Path) -> Optional[FailedStep]:
    """The step of the previous crash (FAILED_STEP_FILE), None when there was none."""
    text = read_marker(str(path))
    if text is None:
        return None
    return int(text) if text.isdigit() else NO_STEP


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.rundir.restart", description="The restart decision "
                                     "of the batch script's exit path; writes `VERDICT CAUSE WHY_NOT STEP EXIT` to "
                                     "--answer and says why on stdout/stderr.")
    parser.add_argument("--run-dir", required=True, type=Path, help="the task's run directory (metrics.jsonl)")
    parser.add_argument("--exit-code", required=True, type=int, help="srun's status")
    parser.add_argument("--attempt", required=True, type=int, help="restarts so far (SLURM_RESTART_COUNT)")
    parser.add_argument("--requeue", required=True, choices=("true", "false"), help="restart.requeue")
    parser.add_argument("--max-requeues", required=True, type=int, help="restart.max_requeues")
    parser.add_argument("--requeue-marker", default="", help="HPCTRAIN_REQUEUE_MARKER")
    parser.add_argument("--bad-input-marker", default="", help="HPCTRAIN_BAD_INPUT_MARKER")
    parser.add_argument("--job-id", default="", help="what scontrol requeue gets (for the message)")
    parser.add_argument("--answer", required=True, type=Path, help="file the answer line is written to")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    policy = RestartConfig.model_validate({"requeue": args.requeue == "true", "max_requeues": args.max_requeues})
    markers = Markers(read_marker(args.requeue_marker), read_marker(args.bad_input_marker))
    raw = (last_metrics(args.run_dir) or {}).get("step")
    step = raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None
    failed_path = args.run_dir / FAILED_STEP_FILE
    decision = decide(args.exit_code, markers, step, read_failed_step(failed_path), args.attempt, policy)
    if decision.cause == RANK_CRASHED and decision.reason != "same-step":
        write_atomic(failed_path, f"{step_key(step)}\n")  # where this crash happened
    for stream, line in message(decision, args.exit_code, step, args.attempt, policy, markers, args.job_id):
        print(line, file=sys.stdout if stream == 1 else sys.stderr, flush=True)
    verdict = "requeue" if decision.requeue else ("done" if decision.cause == FINISHED else "stop")
    answer = (f"{verdict} {decision.cause} {decision.why_not or '-'} {'null' if step is None else step} "
              f"{exit_code_after(decision, args.exit_code)}")
    write_atomic(args.answer, answer + "\n")  # fixed words and digits: the shell `read`s them
    return 0


if __name__ == "__main__":
    sys.exit(main())
