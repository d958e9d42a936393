"""`resume`: resubmit a finished, failed or cancelled run from its newest complete checkpoint.

The run keeps its directory: the job is re-read from its job.yaml (plus new `--set` overrides, e.g.
another layout or node count), re-resolved, re-rendered and submitted again; the runtime loads the
newest complete checkpoint (the checkpoint module decides what "complete" means) and cuts
metrics.jsonl back to that step. The previous job files are kept in submit/previous-N/.

`--dry-run` writes nothing into the run: the new job files and script go to a scratch folder, and the
submission lists what the resolved job would change (`report` of the run keeps telling what it ran).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from hpctrain.config import Job, dump_job, job_to_dict, load_job
from hpctrain.config.paths import absolute_paths
from hpctrain.errors import ConfigError
from hpctrain.launch import rundir, stages
from hpctrain.launch.executor import Executor, choose
from hpctrain.launch.files import write_job_files
from hpctrain.launch.rundir import write_json, write_text
from hpctrain.launch.status import is_active, run_status
from hpctrain.launch.submit import Submission, launch
from hpctrain.rundir.data_identity import check_unchanged
from hpctrain.rundir.events import RESUME_REQUESTED
from hpctrain.rundir.layout import CHECKPOINTS_DIR, JOB_FILE, PLAN_FILE, RESOLVED_FILE, SUBMIT_DIR
from hpctrain.rundir.lock import check_free

_JOB_FILES = (JOB_FILE, RESOLVED_FILE, PLAN_FILE)


def checkpoint_dir(run_dir: Path, configured: Optional[str]) -> Path:
    return Path(configured) if configured else run_dir / CHECKPOINTS_DIR


def _keep_previous(run_dir: Path) -> Path:
    n = 1
    while (run_dir / SUBMIT_DIR / f"previous-{n}").exists():
        n += 1
    keep = run_dir / SUBMIT_DIR / f"previous-{n}"
    keep.mkdir(parents=True)
    for name in _JOB_FILES:
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, keep / name)
    return keep


def resume_run(run_dir: Path, overrides: Sequence[str] = (), *, dry_run: bool = False,
               env: Optional[Mapping[str, str]] = None) -> tuple[Submission, str]:
    """Resubmit run_dir; return (submission, the checkpoint it will resume from)."""
    if rundir.is_sweep(run_dir):
        raise ConfigError(f"RUN: {run_dir.name} is a sweep; resume one of its tasks, e.g. "
                          f"`hpctrain resume {run_dir / rundir.TASKS_DIR / '0'}`")
    status = run_status(run_dir, env)
    if is_active(status):
        raise ConfigError(f"RUN: {run_dir.name} is still {status['state']} (job {status['job_id']}); wait for it or "
                          f"`hpctrain cancel {run_dir}` first")
    check_free(run_dir)  # ranks the scheduler no longer knows about (orphans) still train there
    if not (run_dir / JOB_FILE).is_file():
        raise ConfigError(f"RUN: {run_dir} has no job.yaml; it is not a run directory")
    job = absolute_paths(load_job(str(run_dir / JOB_FILE), overrides))  # --set paths: from where the user is
    stages.check_checkpoint_dir(checkpoint_dir(run_dir, job.checkpoint.dir), run_dir, job.checkpoint.adopt,
                                probe=not dry_run)
    if job.entrypoint is not None:  # the program's own checkpoints, in its own format: it finds them itself
        checkpoint: Optional[Path] = checkpoint_dir(run_dir, job.checkpoint.dir)
        rejected: list[str] = []
    else:
        checkpoint, rejected = stages.newest_complete_checkpoint(checkpoint_dir(run_dir, job.checkpoint.dir))
    if checkpoint is None:
        skipped = f" (skipped: {'; '.join(rejected)})" if rejected else ""
        raise ConfigError(f"RUN: no complete checkpoint in {checkpoint_dir(run_dir, job.checkpoint.dir)}{skipped}; "
                          f"nothing to resume from (submit the job afresh: `hpctrain submit {run_dir / 'job.yaml'}`)")
    executor, note = choose(job, env, dry_run=dry_run)
    executor.check(job)
    if executor.sees_paths(dry_run=dry_run):  # the token files the run trained on, before anything is written or submitted
        check_unchanged(job, run_dir)
    resolved, plan = stages.resolve(job)
    if dry_run:
        return _dry_run(run_dir, job, resolved, plan, executor, note), str(checkpoint)
    kept = _keep_previous(run_dir)
    write_job_files(run_dir, job, resolved, plan)
    rundir.append_event(run_dir, RESUME_REQUESTED, checkpoint=str(checkpoint), overrides=list(overrides),
                        previous=str(kept.relative_to(run_dir)))
    submission = launch(run_dir, resolved, executor, note, [(None, run_dir, resolved)], dry_run=dry_run)
    return submission, str(checkpoint)


def _dry_run(run_dir: Path, job: Job, resolved: Job, plan: dict[str, Any], executor: Executor,
             note: str) -> Submission:
    """`resume --dry-run`: the job files and script rendered into a scratch folder outside the run, and
    what the resolved job would change; nothing in run_dir is written (not even an event)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"hpctrain-resume-{run_dir.name}-"))
    (scratch / SUBMIT_DIR).mkdir()
    write_text(scratch / JOB_FILE, dump_job(job))
    write_text(scratch / RESOLVED_FILE, dump_job(resolved))
    write_json(scratch / PLAN_FILE, plan)
    prepared = executor.prepare(run_dir, resolved, dry_run=True, into=scratch)
    out = Submission(run_dir, executor.name, note, artefact=executor.artefact, scratch=scratch,
                     script_path=prepared.script_path, recipe_path=prepared.recipe_path)
    out.changes = resolved_changes(run_dir / RESOLVED_FILE, resolved)
    return out


def resolved_changes(recorded: Path, resolved: Job) -> list[str]:
    """`key: old -> new` for every leaf of the resolved job that differs from the run's recorded one."""
    try:
        before = yaml.safe_load(recorded.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        return [f"(cannot read {recorded}: {exc}; every value is new)"]
    old, new = _leaves(before), _leaves(job_to_dict(resolved))
    return [f"{key}: {_short(old.get(key, '(unset)'))} -> {_short(new.get(key, '(unset)'))}"
            for key in sorted(set(old) | set(new)) if old.get(key, _UNSET) != new.get(key, _UNSET)]


_UNSET = object()


def _leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict) or not data:
        return {prefix: data} if prefix else {}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
