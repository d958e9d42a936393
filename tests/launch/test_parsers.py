"""Table-driven tests of the parsers of Slurm output (hpctrain/launch/slurm/parsers.py) and the retrying wrapper."""

from __future__ import annotations

import subprocess

import pytest

from hpctrain.errors import ConfigError, SubmissionError
from hpctrain.launch.slurm import parsers
from hpctrain.launch.slurm.parsers import JobRecord
from hpctrain.launch.slurm.commands import RetryPolicy, SlurmCommands


@pytest.mark.parametrize("raw, state", [
    ("COMPLETED", "COMPLETED"),
    ("CANCELLED by 0", "CANCELLED"),
    ("RUNNING+", "RUNNING"),
    ("  pending ", "PENDING"),
    ("", "UNKNOWN"),
])
def test_normalize_state(raw: str, state: str) -> None:
    assert parsers.normalize_state(raw) == state


@pytest.mark.parametrize("output, job_id", [
    ("12\n", "12"),
    ("12;hpctest\n", "12"),
    ("sbatch: warning: something\n345\n", "345"),
])
def test_parse_sbatch_parsable(output: str, job_id: str) -> None:
    assert parsers.parse_sbatch_parsable(output) == job_id


def test_parse_sbatch_parsable_without_id() -> None:
    with pytest.raises(ValueError, match="no job id"):
        parsers.parse_sbatch_parsable("Submitted batch job\n")


@pytest.mark.parametrize("stderr, transient", [
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", True),
    ("squeue: error: Unable to contact slurm controller (connect failure)", True),
    ("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying", True),
    ("sbatch: error: invalid partition specified: nope", False),
    ("sbatch: error: Batch job submission failed: Invalid account or account/partition combination", False),
    ("", False),
])
def test_is_transient(stderr: str, transient: bool) -> None:
    assert parsers.is_transient(stderr) is transient


@pytest.mark.parametrize("stderr, message", [
    ("sbatch: error: invalid partition specified: nope\n"
     "sbatch: error: Batch job submission failed: Invalid partition name specified\n",
     "invalid partition specified: nope; Batch job submission failed: Invalid partition name specified"),
    ("scancel: error: Invalid job id 99\n", "Invalid job id 99"),
    ("\n", "(no message)"),
    ("plain text\nplain text\n", "plain text"),
])
def test_slurm_error_message(stderr: str, message: str) -> None:
    assert parsers.slurm_error_message(stderr) == message


@pytest.mark.parametrize("text, tasks", [
    ("0-3%2", [0, 1, 2, 3]),
    ("[2-3]", [2, 3]),
    ("1,4-5", [1, 4, 5]),
    ("7", [7]),
])
def test_expand_task_range(text: str, tasks: list[int]) -> None:
    assert parsers.expand_task_range(text) == tasks


SCONTROL = (
    "JobId=1 ArrayJobId=1 ArrayTaskId=3 ArrayTaskThrottle=2 JobName=my job UserId=root(0) JobState=COMPLETED "
    "Reason=None Requeue=1 Restarts=0 ExitCode=0:0 NodeList=node[1-2] BatchHost=node1\n"
    "JobId=4 ArrayJobId=1 ArrayTaskId=2 JobState=RUNNING Reason=None Restarts=2 ExitCode=0:0 NodeList=node1\n"
    "JobId=1 ArrayJobId=1 ArrayTaskId=4-5%2 JobState=PENDING Reason=JobArrayTaskLimit Restarts=0 "
    "NodeList=(null)\n"
    "JobId=9 JobName=single JobState=CANCELLED Reason=None Restarts=1 ExitCode=0:15 NodeList=node2\n"
)


def test_parse_scontrol_jobs() -> None:
    records = parsers.parse_scontrol_jobs(SCONTROL)
    assert records == [
        JobRecord("1_3", "COMPLETED", "1", 3, 0, "node[1-2]", "None", "0:0"),
        JobRecord("1_2", "RUNNING", "1", 2, 2, "node1", "None", "0:0"),
        JobRecord("1_4", "PENDING", "1", 4, 0, "", "JobArrayTaskLimit", ""),
        JobRecord("1_5", "PENDING", "1", 5, 0, "", "JobArrayTaskLimit", ""),
        JobRecord("9", "CANCELLED", None, None, 1, "node2", "None", "0:15"),
    ]


def test_parse_scontrol_record_keeps_spaces_in_values() -> None:
    assert parsers.parse_scontrol_record("JobId=3 JobName=a b c Partition=low")["JobName"] == "a b c"


@pytest.mark.parametrize("text, expected", [
    ("12|RUNNING|node[1-2]|None\n", [JobRecord("12", "RUNNING", nodes="node[1-2]", reason="None")]),
    ("5_0|RUNNING|node1|None\n5_[2-3%2]|PENDING||JobArrayTaskLimit\n",
     [JobRecord("5_0", "RUNNING", "5", 0, None, "node1", "None"),
      JobRecord("5_2", "PENDING", "5", 2, None, "", "JobArrayTaskLimit"),
      JobRecord("5_3", "PENDING", "5", 3, None, "", "JobArrayTaskLimit")]),
    ("\n", []),
])
def test_parse_squeue(text: str, expected: list[JobRecord]) -> None:
    assert parsers.parse_squeue(text) == expected


@pytest.mark.parametrize("text, expected", [
    # a requeued job appears once per start with --duplicates: restarts = rows - 1, state = the last row
    ("7|REQUEUED|0:0|node1\n7|REQUEUED|0:0|node2\n7|COMPLETED|0:0|node1\n7.batch|COMPLETED|0:0|node1\n",
     [JobRecord("7", "COMPLETED", None, None, 2, "node1", "", "0:0")]),
    ("3_0|COMPLETED|0:0|node1\n3_1|CANCELLED by 0|0:15|node2\n3_[2-3%2]|PENDING|0:0|None assigned\n",
     [JobRecord("3_0", "COMPLETED", "3", 0, 0, "node1", "", "0:0"),
      JobRecord("3_1", "CANCELLED", "3", 1, 0, "node2", "", "0:15"),
      JobRecord("3_2", "PENDING", "3", 2, 0, "", "", "0:0"),
      JobRecord("3_3", "PENDING", "3", 3, 0, "", "", "0:0")]),
])
def test_parse_sacct(text: str, expected: list[JobRecord]) -> None:
    assert parsers.parse_sacct(text) == expected


class FlakyRunner:
    """A subprocess.run stand-in: Slurm cannot time out on demand, so the fault is injected here."""

    def __init__(self, results: list[tuple[int, str, str]]) -> None:
        self.results = list(results)
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        code, out, err = self.results.pop(0)
        return subprocess.CompletedProcess(argv, code, out, err)


TIMED_OUT = (1, "", "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation\n")


def _commands(runner: FlakyRunner, sleeps: list[float]) -> SlurmCommands:
    return SlurmCommands(RetryPolicy(attempts=3, first_delay_s=0.5), runner=runner, sleep=sleeps.append)


def test_sbatch_retries_socket_timeouts_with_backoff() -> None:
    runner, sleeps = FlakyRunner([TIMED_OUT, TIMED_OUT, (0, "42\n", "")]), []
    assert _commands(runner, sleeps).sbatch("/tmp/x.sh") == "42"
    assert len(runner.calls) == 3 and sleeps == [0.5, 1.0]


def test_sbatch_gives_up_after_bounded_retries() -> None:
    runner, sleeps = FlakyRunner([TIMED_OUT] * 3), []
    with pytest.raises(SubmissionError, match=r"after 3 tries.*Socket timed out") as info:
        _commands(runner, sleeps).sbatch("/tmp/x.sh")
    assert info.value.exit_code == 3 and len(runner.calls) == 3 and sleeps == [0.5, 1.0]


def test_sbatch_refusal_is_not_retried() -> None:
    runner, sleeps = FlakyRunner([(1, "", "sbatch: error: invalid partition specified: nope\n")]), []
    with pytest.raises(SubmissionError, match="invalid partition specified: nope"):
        _commands(runner, sleeps).sbatch("/tmp/x.sh")
    assert len(runner.calls) == 1 and sleeps == []


def test_missing_program_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    commands = SlurmCommands(env={"PATH": "/nonexistent"})
    with pytest.raises(ConfigError, match="sbatch. but it is not on PATH") as info:
        commands.sbatch("/tmp/x.sh")
    assert info.value.exit_code == 2
