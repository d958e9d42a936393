"""The Slurm executor: the rendered sbatch script, submitted through submitit; state and cancel through
`SlurmCommands` (the one wrapper of every Slurm client call).

Submission and arrays go through submitit (`submission.RenderedSlurmExecutor`, imported when a job is
submitted: submitit costs ~130 ms to import, which `status` and `cancel` do not pay). A sweep is ONE
array: one script with `#SBATCH --array=0-N%K`, one sbatch call; task T is the Slurm job `<id>_T`.

Why job state and cancel do not go through submitit's `SlurmJob` and its `SlurmInfoWatcher` (read from
submitit 1.5's slurm.py):
- the watcher asks sacct only (`sacct -o JobID,State,NodeList`). sacct lags slurmctld by seconds (a job
  just submitted is absent, so `submit --wait` would start on UNKNOWN) and has no restart count and no
  pending reason; `hpctrain status` shows both, from `scontrol show job` first, then sacct with
  `--duplicates` for jobs slurmctld has forgotten (`SlurmCommands.jobs`, parsed in `parsers`).
- it runs sacct with `subprocess.check_output`, without a timeout, and turns every failure into a
  logged warning; ours has a timeout, bounded retries on a busy controller, and says what failed.
- it caches finished states in a class attribute shared by the process and refreshes at most every
  `delay_s` (600 s for SlurmJob): right for one Python program waiting for its own jobs, wrong for a
  `status` that must answer now for jobs another process submitted.
- `Job.cancel` runs scancel with `check_call` and no timeout; a refusal would be a CalledProcessError
  instead of Slurm's message (exit 3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from hpctrain.config import Job
from hpctrain.errors import ConfigError
from hpctrain.launch import stages
from hpctrain.launch.executor import Executor, Handle, Prepared, SchedulerState, TaskSpec, UNKNOWN
from hpctrain.launch.files import write_recipe, write_script
from hpctrain.launch.slurm.commands import SlurmCommands, missing_program_error, sbatch_available
from hpctrain.launch.slurm.parsers import JobRecord
from hpctrain.rundir.layout import SUBMIT_DIR


class SlurmExecutor(Executor):
    """sbatch (through submitit), scontrol/sacct for state, scancel."""

    name = "slurm"
    supports_arrays = True

    def __init__(self, env: Optional[Mapping[str, str]] = None, commands: Optional[SlurmCommands] = None) -> None:
        super().__init__(env)
        self.commands = commands or SlurmCommands(env=dict(env) if env is not None else None)

    def describe(self, job: Job, *, dry_run: bool = False) -> str:
        if sbatch_available(self.env) is None:
            if dry_run:
                return "executor: slurm (cluster.executor; dry run: no sbatch on PATH, none needed)"
            raise missing_program_error("sbatch")
        return "executor: slurm (cluster.executor)"

    def sees_paths(self, *, dry_run: bool = False) -> bool:
        """A dry run without sbatch here renders for a cluster whose file system this machine need not see."""
        return not dry_run or sbatch_available(self.env) is not None

    def check_sweep(self, points: Sequence[tuple[str, Job]], root: Path, array: str) -> None:
        """One array runs one script: every point must render to the same text (same nodes, GPUs, sbatch
        options, placement); the task-specific part is read from tasks/<id>/job.resolved.yaml at run time."""
        first_label, first_job = points[0]
        first = stages.render_script(first_job, root, array=array)
        for label, resolved in points[1:]:
            if stages.render_script(resolved, root, array=array) != first:
                raise ConfigError(f"sweep.grid: point {label} needs another sbatch script than {first_label} "
                                  "(nodes, GPUs, sbatch options or rank placement differ), and one job array runs "
                                  "one script; sweep those keys in separate submissions")

    def prepare(self, run_dir: Path, resolved: Job, *, array: Optional[str] = None,
                dry_run: bool = False, into: Optional[Path] = None) -> Prepared:
        _, script = write_script(run_dir, resolved, array, into)
        return Prepared(script, write_recipe(run_dir, resolved, into) if dry_run else None)

    def submit(self, run_dir: Path, resolved: Job, tasks: list[TaskSpec], prepared: Prepared, *,
               array: Optional[str] = None, max_parallel: int = 1) -> Handle:
        from hpctrain.launch.slurm.submission import RenderedSlurmExecutor  # submitit: only when submitting

        if prepared.script_path is None:
            raise ValueError("SlurmExecutor.submit needs the script written by prepare")
        executor = RenderedSlurmExecutor(run_dir / SUBMIT_DIR, prepared.script_path.read_text(), self.commands)
        return Handle(executor.submit_rendered())

    def state(self, submitted: Mapping[str, Any], jobs: Sequence[tuple[str, Path]]) -> dict[str, SchedulerState]:
        records: dict[str, JobRecord] = {}
        for main_id in dict.fromkeys(job_id.split("_", 1)[0] for job_id, _ in jobs):  # an array: one query
            records.update((r.job_id, r) for r in self.commands.jobs(main_id))
        return {job_id: _scheduler_state(records[job_id]) if job_id in records else UNKNOWN for job_id, _ in jobs}

    def cancel(self, submitted: Mapping[str, Any], job_id: str, task_id: Optional[int] = None) -> bool:
        self.commands.scancel(job_id)  # `<id>_<task>` cancels one array task
        return True


def _scheduler_state(record: JobRecord) -> SchedulerState:
    reason = record.reason if record.reason not in ("", "None") else None
    return SchedulerState(record.state, reason, record.restarts or 0)
