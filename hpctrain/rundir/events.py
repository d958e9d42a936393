"""events.jsonl and the other JSON-lines files of a run: the record format, the writer, the reader.

One lifecycle record per line: {"time": ISO 8601 UTC with milliseconds, "event": NAME, ...fields}.
Writers: the launcher (submitted, resume_requested, ended ...), the runtime's rank 0 (started,
checkpoint_saved, finished, failed ...) and the batch script's exit path (requeued, not_requeued),
which writes the same format with `printf` (it runs on the host, where hpctrain need not be
installed when the ranks run in a container); tests/render/test_exit_path.py reads its lines back here.
Each record is one O_APPEND write, so concurrent writers never interleave within a line.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

from hpctrain.rundir.layout import EVENTS_FILE
from hpctrain.rundir.read import RunDirError, damaged, decode
from hpctrain.rundir.safe_files import append

# Every event name, as written in the `event` field (docs/architecture.md section 3). Writers and readers
# name events through these constants; `hpctrain doctor` also reads older spellings (diagnose/rundata.py).
# The launcher (launch/):
SUBMITTED = "submitted"
DRY_RUN = "dry_run"
RESUME_REQUESTED = "resume_requested"
CANCEL_REQUESTED = "cancel_requested"
ENDED = "ended"  # the local supervisor: the job's final state, reason and exit codes
LAYOUT_CHANGED = "layout_changed"  # an elastic start re-planned (hpctrain/launch/replan.py)
# The runtime's rank 0 (runtime/):
STARTED = "started"
WEIGHTS_LOADED = "weights loaded"
RESUMED = "resumed"
CHECKPOINT_SAVED = "checkpoint saved"
CHECKPOINT_FAILED = "checkpoint failed"
CHECKPOINT_ADOPTED = "checkpoint adopted"
CHECKPOINT_SKIPPED = "checkpoint skipped"
CHECKPOINT_SUPERSEDED = "checkpoint superseded"
SIGNAL = "signal"
TIME_LIMIT_NEAR = "time limit near"
REQUEUE_REQUESTED = "requeue requested"
STOPPED = "stopped"
FINISHED = "finished"
FAILED = "failed"  # also the launcher's, with stage="submit", when the scheduler refused the job
# The `reason` of the Ray driver's `failed` event (stage "ray-driver") when it lost its head, and of `status`
# for a Ray job that its head no longer knows (hpctrain/launch/ray/driver.py, executor.py).
RAY_HEAD_GONE = "the Ray head is gone"
RAY_HEAD_LOST_JOB = "the Ray head lost the job"
# The runtime, the Ray driver and the batch script's exit path (sbatch_templates/exit_path.sh.j2, deciding
# with rundir/restart.py), with their `reason` / `why_not` words, so that status and the doctor can explain them.
REQUEUED = "requeued"
NOT_REQUEUED = "not_requeued"
WHY_NOT_REQUEUED = {
    "bad-input": "a rank exited 2: the job's input is wrong, a requeue would fail the same way",
    "same-step": "it failed again at the same step after a requeue",
    "max-requeues-reached": "restart.max_requeues requeues are used up",
    "requeue-disabled": "restart.requeue is false",
    "scontrol-failed": "scontrol requeue failed",
    "policy-failed": "the restart policy (python -m hpctrain.rundir.restart) did not answer",
}


def now_iso() -> str:
    """The time format of every record: UTC ISO 8601 with milliseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def append_line(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """One JSON line, written with a single O_APPEND write (no torn lines from concurrent writers), never
    through a symbolic link (rundir/safe_files.py)."""
    append(path, (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode("utf-8"))


def append_event(run_dir: str | os.PathLike[str], event: str, **fields: Any) -> dict[str, Any]:
    """Append one lifecycle record to RUN_DIR/events.jsonl and return it."""
    record = {"time": now_iso(), "event": event, **fields}
    append_line(Path(run_dir) / EVENTS_FILE, record)
    return record


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file ([] when it does not exist).

    A line that is not JSON is skipped: a torn last line of a running job, or a stray line. Bytes that
    are not UTF-8 are a RunDirError (the file was damaged, not torn), unless they are in a last line
    without its newline (a write cut short).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise damaged(path, f"cannot read it ({exc.strerror})") from None
    raw_lines = data.split(b"\n")
    out = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        torn = number == len(raw_lines)  # the last piece has no newline after it
        try:
            line = decode(path, raw, line=number)
        except RunDirError:
            if torn:
                continue
            raise
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            if not isinstance(record.get("event", ""), str) and path.name == EVENTS_FILE:
                raise damaged(path, f"line {number}: field 'event' is {record['event']!r}, not a name")
            out.append(record)
    return out


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The run's lifecycle records, oldest first."""
    return read_jsonl(Path(run_dir) / EVENTS_FILE)
