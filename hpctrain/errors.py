"""The exception hierarchy. Each class carries the process exit code the CLI maps it to.

Exit codes (docs/architecture.md section 4): 0 success, 1 the job ran and failed,
2 the user's input is wrong, 3 the scheduler refused or failed, 4 a wait (`--wait`, `follow`) timed out
while the job goes on, 130 following was interrupted (Ctrl-C) while the job goes on.
"""

from __future__ import annotations


class HpctrainError(Exception):
    """Base of every error hpctrain reports to the user without a traceback."""

    exit_code = 1


class ConfigError(HpctrainError):
    """job.yaml, an override or a CLI argument is wrong. The message holds one line per problem."""

    exit_code = 2

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class PlanError(ConfigError):
    """The job cannot be laid out on the cluster it names (no layout fits, impossible degrees)."""


class RenderError(ConfigError):
    """A template or a value cannot be rendered into a safe script."""


class SubmissionError(HpctrainError):
    """The scheduler refused the job or failed (sbatch error, Slurm unreachable)."""

    exit_code = 3


class JobFailedError(HpctrainError):
    """The job ran and failed."""

    exit_code = 1


class WaitTimedOut(HpctrainError):
    """`--wait` or `follow` gave up after its timeout; the job itself goes on (neither failed nor ended)."""

    exit_code = 4
