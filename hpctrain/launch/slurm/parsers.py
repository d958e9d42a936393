"""Parsers of Slurm's command output: small pure functions, each with a table-driven test.

Nothing here runs a command; `hpctrain.launch.slurm.commands` runs them and hands the text over.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from hpctrain.rundir.states import LIVE_SLURM_STATES

# Slurm's job states that will not change any more (sacct / scontrol spelling).
TERMINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
})
ACTIVE_STATES = LIVE_SLURM_STATES  # kept in hpctrain.rundir.states, shared with diagnose

# Errors after which the same command is worth trying again (slurmctld busy or restarting);
# submitit issue 1659 is the "Socket timed out" one.
_TRANSIENT = re.compile(
    r"Socket timed out|Unable to contact slurm controller|Transport endpoint is not connected|"
    r"Connection refused|Resource temporarily unavailable|Zero Bytes were transmitted|"
    r"slurm_persist_conn_open|Slurm temporarily unable to accept job",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class JobRecord:
    """One job or array task as Slurm reports it (squeue, scontrol or sacct)."""

    job_id: str  # "12" or "12_3" for an array task
    state: str  # normalised: "CANCELLED by 0" -> "CANCELLED"
    array_job_id: Optional[str] = None
    array_task_id: Optional[int] = None
    restarts: Optional[int] = None
    nodes: str = ""
    reason: str = ""
    exit_code: str = ""


def normalize_state(raw: str) -> str:
    """`CANCELLED by 0` -> `CANCELLED`, `RUNNING+` (scontrol flags) -> `RUNNING`, '' -> `UNKNOWN`."""
    word = raw.strip().split(" ", 1)[0].rstrip("+*") if raw.strip() else ""
    return word.upper() or "UNKNOWN"


def is_transient(message: str) -> bool:
    """True when a failed Slurm command is worth retrying (the controller was busy or away)."""
    return bool(_TRANSIENT.search(message))


def parse_sbatch_parsable(output: str) -> str:
    """The job id from `sbatch --parsable` output ("12" or "12;cluster"); ValueError if none."""
    for line in output.strip().splitlines():
        head = line.strip().split(";", 1)[0]
        if head.isdigit():
            return head
    raise ValueError(f"no job id in sbatch output {output.strip()!r}")


def slurm_error_message(stderr: str) -> str:
    """Slurm's own words from a client's stderr, without the repeated `sbatch: error:` prefixes.

    sbatch prints the specific reason first ("invalid partition specified: nope") and then the
    generic one ("Batch job submission failed: Invalid partition name specified"); keep both.
    """
    lines = []
    for line in stderr.strip().splitlines():
        text = re.sub(r"^\s*(sbatch|squeue|sacct|scontrol|scancel|srun):\s*(error:\s*)?", "", line).strip()
        if text and text not in lines:
            lines.append(text)
    return "; ".join(lines) or "(no message)"


def parse_scontrol_record(line: str) -> dict[str, str]:
    """`Key=Value Key2=Value with spaces ...` (one `scontrol show -o` line) into a dict."""
    pairs = re.finditer(r"(?:^|\s)([A-Za-z][\w:/.]*)=(.*?)(?=\s[A-Za-z][\w:/.]*=|\s*$)", line.strip())
    return {m.group(1): m.group(2) for m in pairs}


def _int_or_none(text: Optional[str]) -> Optional[int]:
    return int(text) if text is not None and text.strip().isdigit() else None


def parse_scontrol_jobs(text: str) -> list[JobRecord]:
    """`scontrol show job -o ID` output (one line per job or array task) into records."""
    records = []
    for line in text.splitlines():
        if not line.strip().startswith("JobId="):
            continue
        fields = parse_scontrol_record(line)
        array_job, task = fields.get("ArrayJobId"), _int_or_none(fields.get("ArrayTaskId"))
        job_id = f"{array_job}_{task}" if array_job and task is not None else fields["JobId"]
        nodes = fields.get("NodeList", "")
        records.append(JobRecord(
            job_id=job_id, state=normalize_state(fields.get("JobState", "")), array_job_id=array_job,
            array_task_id=task, restarts=_int_or_none(fields.get("Restarts")),
            nodes="" if nodes == "(null)" else nodes, reason=fields.get("Reason", ""),
            exit_code=fields.get("ExitCode", ""),
        ))
        if array_job and task is None and "ArrayTaskId" in fields:  # pending range "2-3%2"
            records[-1:] = [_replace_id(records[-1], array_job, t)
                            for t in expand_task_range(fields["ArrayTaskId"])]
    return records


def _replace_id(record: JobRecord, array_job: str, task: int) -> JobRecord:
    return JobRecord(f"{array_job}_{task}", record.state, array_job, task, record.restarts, record.nodes,
                     record.reason, record.exit_code)


def expand_task_range(text: str) -> list[int]:
    """`0-3%2`, `1,4-5`, `[2-3]` (array task id ranges) into [task ids]."""
    body = text.strip().strip("[]").split("%", 1)[0]
    out: list[int] = []
    for part in filter(None, body.split(",")):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


def parse_squeue(text: str) -> list[JobRecord]:
    """`squeue -h -r -o '%i|%T|%N|%r'` lines into records (array tasks as `ID_TASK`)."""
    records = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        job_id, state = parts[0], normalize_state(parts[1])
        nodes = parts[2] if len(parts) > 2 else ""
        reason = parts[3] if len(parts) > 3 else ""
        records.extend(_split_job_id(job_id, JobRecord(job_id, state, nodes=nodes, reason=reason)))
    return records


def _split_job_id(job_id: str, record: JobRecord) -> list[JobRecord]:
    """`12` -> as is; `12_3` -> array task 3; `12_[4-5%2]` -> tasks 4 and 5."""
    main, sep, rest = job_id.partition("_")
    if not sep:
        return [record]
    if rest.isdigit():
        return [_replace_id(record, main, int(rest))]
    return [_replace_id(record, main, t) for t in expand_task_range(rest)]


def parse_sacct(text: str) -> list[JobRecord]:
    """`sacct -n -P -X -o JobID,State,ExitCode,NodeList` lines into records.

    With `--duplicates` a requeued job appears once per start; the count of rows for one id
    minus one is its restart count, and the last row is its current state.
    """
    rows: dict[str, list[JobRecord]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0] or "." in parts[0]:
            continue  # job steps (12.batch, 12.0) are not jobs
        record = JobRecord(parts[0], normalize_state(parts[1]),
                           exit_code=parts[2] if len(parts) > 2 else "",
                           nodes=parts[3] if len(parts) > 3 and parts[3] != "None assigned" else "")
        for item in _split_job_id(parts[0], record):
            rows.setdefault(item.job_id, []).append(item)
    out = []
    for job_id, seen in rows.items():
        last = seen[-1]
        out.append(JobRecord(job_id, last.state, last.array_job_id, last.array_task_id, len(seen) - 1,
                             last.nodes, last.reason, last.exit_code))
    return out
