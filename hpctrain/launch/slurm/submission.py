"""submitit's Slurm executor, with hpctrain's rendered script as the submission file.

submitit builds a submission file (`_make_submission_file_text`), runs a submission command
(`_make_submission_command`) and parses the job id (`_get_job_id_from_submission_command`): its
documented hooks, which we fill. The file is the render stage's script, so what `hpctrain render`
shows is byte for byte what Slurm receives; the script starts the runtime itself (no pickled
function, so `submit(fn)` and its pickles are not used: `_submit_command` is the entry point, as for
submitit's own command jobs). submitit runs sbatch through `CommandFunction`, which has no timeout
and no retry; our `_submit_command` is submitit's with that one call replaced by `SlurmCommands.sbatch`
(timeouts, bounded retries on "Socket timed out", Slurm's own message on refusal). The job it returns
is submitit's `SlurmJob`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Union

import submitit
from submitit.core import core, utils

from hpctrain.launch.slurm.commands import SlurmCommands, missing_program_error, sbatch_available
from hpctrain.launch.slurm.parsers import parse_sbatch_parsable


class RenderedSlurmExecutor(submitit.SlurmExecutor):
    """Submits one rendered sbatch script (a job, or one array for a sweep) from `folder`."""

    def __init__(self, folder: Union[str, Path], script_text: str, commands: SlurmCommands) -> None:
        if sbatch_available(commands.env) is None:
            raise missing_program_error("sbatch")
        try:
            # submitit's own __init__: the folder, its parameters, and its check that srun is here (the batch
            # script runs the ranks with srun; a login node with sbatch but no srun is a broken Slurm client)
            super().__init__(folder, python="python3")
        except RuntimeError:
            raise missing_program_error("srun") from None
        self.script_text = script_text
        self.commands = commands
        self._throttling = 0.0  # one submission per command: nothing to pace

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script_text

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["sbatch", "--parsable", str(submission_file_path)]

    @staticmethod
    def _get_job_id_from_submission_command(string: Union[bytes, str]) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        try:
            return parse_sbatch_parsable(text)
        except ValueError as exc:
            raise utils.FailedSubmissionError(str(exc)) from None

    def _submit_command(self, command: str) -> core.Job[Any]:
        """submitit's _submit_command, with sbatch run by SlurmCommands instead of CommandFunction."""
        tmp_uuid = uuid.uuid4().hex
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        submission_file_path = folder / f".submission_file_{tmp_uuid}.sh"
        submission_file_path.write_text(self._make_submission_file_text(command, tmp_uuid))
        argv = self._make_submission_command(submission_file_path)
        try:
            job_id = self.commands.sbatch(argv[-1], *argv[2:-1])
        except BaseException:
            submission_file_path.unlink(missing_ok=True)  # the refused text is in submit/ as rendered
            raise
        job: core.Job[Any] = self.job_class(folder=self.folder, job_id=job_id, tasks=[0])
        job.paths.move_temporary_file(submission_file_path, "submission_file", keep_as_symlink=False)
        return job

    def submit_rendered(self) -> str:
        """Submit the script once; return the job id (the array job id for a sweep)."""
        return self._submit_command("").job_id
