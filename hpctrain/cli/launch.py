"""CLI commands of the launch stage: submit, sweep, status, cancel, logs, resume.

Only argparse is imported at module level; each handler imports its stage code when it runs.
"""

from __future__ import annotations

import argparse

from hpctrain.cli.options import add_set_option

TYPE_CHECKING = False  # the constant mypy understands, without importing typing on the login path
if TYPE_CHECKING:
    from typing import Any

    from hpctrain.config import Job

_RUN_HELP = "a run directory, or a run name (the newest runs/<name>-* is used)"


def _add_runs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where to look for RUN by name (default: runs)")


def _add_wait(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", action="store_true", help="follow the job with a progress bar until it ends "
                                                            "(exit 1 if it fails)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up waiting after this long (default: the job's time limit x (1 + max_requeues) "
                             "+ 10 min, or 24 h)")


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    submit = subparsers.add_parser("submit", help="submit a job (Slurm, or local processes)",
                                   description="Resolve the job, create runs/<name>-<time>/, render the sbatch script "
                                               "and submit it (or start local processes); prints the job id and the "
                                               "run directory. Exit 2: bad input; 3: the scheduler refused.")
    submit.add_argument("job", metavar="JOB.yaml", help="the job file to submit")
    add_set_option(submit)
    submit.add_argument("--dry-run", action="store_true", help="write the run directory and script, submit nothing")
    _add_wait(submit)
    submit.set_defaults(handler=run_submit)

    sweep = subparsers.add_parser("sweep", help="submit a grid of jobs as ONE job array",
                                  description="Expand the grid (the job's `sweep:` section and/or --grid), drop "
                                              "infeasible points with the planner's reason, submit one array "
                                              "(--array=0-N%K); each task reads its own resolved job.")
    sweep.add_argument("job", metavar="JOB.yaml", help="the job file whose grid to submit")
    add_set_option(sweep)
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                       help="a grid axis, e.g. --grid parallel.tp=1,2,4 (repeatable; adds to or replaces sweep.grid)")
    sweep.add_argument("--max-parallel", type=int, default=None, metavar="K", help="array tasks at once (%%K)")
    sweep.add_argument("--dry-run", action="store_true", help="write the run directories and script, submit nothing")
    sweep.set_defaults(handler=run_sweep)

    status = subparsers.add_parser("status", help="state, restarts, step and tokens/s of a run or sweep; "
                                                   "without RUN, a list of the runs in --runs-dir")
    status.add_argument("run", nargs="?", metavar="RUN",
                        help=_RUN_HELP + " (default: list every run, newest first)")
    status.add_argument("--json", action="store_true", help="print a JSON object")
    _add_runs_dir(status)
    status.set_defaults(handler=run_status_cmd)

    cancel = subparsers.add_parser("cancel", help="cancel a run (all tasks of a sweep)")
    cancel.add_argument("run", metavar="RUN", help=_RUN_HELP)
    cancel.add_argument("--task", type=int, default=None, metavar="T", help="cancel only array task T of a sweep")
    _add_runs_dir(cancel)
    cancel.set_defaults(handler=run_cancel)

    logs = subparsers.add_parser("logs", help="print a run's per-rank logs (newest attempt)")
    logs.add_argument("run", metavar="RUN", help=_RUN_HELP + "; for a sweep task: RUN/tasks/T")
    logs.add_argument("--rank", type=int, default=None, metavar="R", help="only rank R (default: every rank)")
    logs.add_argument("--attempt", type=int, default=None, metavar="A", help="attempt A (default: the newest)")
    _add_runs_dir(logs)
    logs.set_defaults(handler=run_logs)

    resume = subparsers.add_parser("resume", help="resubmit a run from its newest complete checkpoint",
                                   description="Resubmit a finished, failed or cancelled run in the same run "
                                               "directory; --set may change the layout or node count.")
    resume.add_argument("run", metavar="RUN", help=_RUN_HELP)
    add_set_option(resume)
    resume.add_argument("--dry-run", action="store_true", help="render the new job files and script into a scratch "
                                                               "folder and list what would change; the run is "
                                                               "left as it is and nothing is submitted")
    _add_wait(resume)
    _add_runs_dir(resume)
    resume.set_defaults(handler=run_resume)


def _print_submission(submission: Any, dry_run: bool) -> None:
    import sys

    print(submission.executor_note, file=sys.stderr)
    if dry_run:
        kind = submission.artefact  # "script", or a volcano Job's "manifest"
        where = f"; {kind} {submission.script_path}" if submission.script_path else ""
        where += f"; recipe {submission.recipe_path}" if submission.recipe_path else ""
        print(f"dry run: nothing submitted{where}")
    else:
        print(f"job {submission.job_id}")
    print(f"run {submission.run_dir}")


def _wait_timeout_s(job: Job) -> float:
    from hpctrain.config.types import slurm_time_seconds

    if job.slurm.time is None:
        return 24 * 3600.0
    return slurm_time_seconds(job.slurm.time) * (1 + job.restart.max_requeues) + 600.0


def run_submit(args: argparse.Namespace) -> int:
    from hpctrain.config import load_job
    from hpctrain.config.paths import absolute_paths
    from hpctrain.launch.submit import submit_job

    job = absolute_paths(load_job(args.job, args.overrides))
    submission = submit_job(job, dry_run=args.dry_run)
    _print_submission(submission, args.dry_run)
    if args.wait and not args.dry_run:
        _wait(submission, job, args.timeout)
    return 0


def _wait(submission: Any, job: Job, timeout: Any) -> None:
    """`--wait`: follow the job to its end (JobFailedError unless it completed)."""
    from hpctrain.launch.follow import FollowInterrupted, follow

    try:
        timeout_s = timeout if timeout is not None else _wait_timeout_s(job)
        proc = submission.process
        status = follow(submission.run_dir, timeout_s, on_poll=proc.poll if proc else None, job_id=submission.job_id)
    except KeyboardInterrupt:  # Ctrl-C between the submission and the first poll: the job goes on all the same
        raise FollowInterrupted(submission.run_dir, submission.job_id) from None
    print(f"{status['state']} at step {status.get('step')}")


def run_sweep(args: argparse.Namespace) -> int:
    import sys

    from hpctrain.config import load_job
    from hpctrain.config.paths import absolute_paths
    from hpctrain.launch.sweep import point_label, submit_sweep

    job = absolute_paths(load_job(args.job, args.overrides))
    submission, sweep = submit_sweep(job, args.grid, max_parallel=args.max_parallel, dry_run=args.dry_run)
    for skipped in sweep["skipped"]:
        reason = " ".join(line.strip() for line in skipped["reason"].splitlines())
        print(f"skipped {point_label(skipped['point'])}: {reason}", file=sys.stderr)
    print(f"{len(sweep['tasks'])} tasks, {len(sweep['skipped'])} skipped; array {sweep['array']}", file=sys.stderr)
    _print_submission(submission, args.dry_run)
    return 0


def _find(args: argparse.Namespace) -> Any:
    from hpctrain.launch.rundir import find_run, newest_run

    return find_run(args.run, args.runs_dir) if args.run else newest_run(args.runs_dir)


def run_status_cmd(args: argparse.Namespace) -> int:
    import json

    from hpctrain.launch.status import format_table, json_safe, run_status

    if args.run is None:  # every run, newest first
        from hpctrain.launch.listing import format_runs, list_runs

        rows = list_runs(args.runs_dir)
        print(json.dumps(json_safe(rows), indent=2, default=str, allow_nan=False) if args.json
              else format_runs(rows, args.runs_dir))
        return 0
    status = run_status(_find(args))
    print(json.dumps(json_safe(status), indent=2, default=str, allow_nan=False) if args.json
          else format_table(status))
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    from hpctrain.launch.cancel import cancel_run

    run_dir = _find(args)
    job_id, ended = cancel_run(run_dir, args.task)
    if ended:
        print(f"job {job_id} had already ended ({ended}); nothing to cancel ({run_dir})")
    else:
        print(f"cancelled job {job_id} ({run_dir})")
    return 0


def run_logs(args: argparse.Namespace) -> int:
    import shutil
    import sys

    from hpctrain.launch.logs import pick_logs, remote_logs

    run_dir = _find(args)
    remote = remote_logs(run_dir)  # logs the executor keeps elsewhere (a Volcano Job's pod output)
    if remote is not None:
        print(f"hpctrain logs: {remote.note}", file=sys.stderr)
        sys.stdout.write(remote.text)
        return 0
    files, note = pick_logs(run_dir, args.rank, args.attempt)
    if note:
        print(f"hpctrain logs: {note}", file=sys.stderr)
    for log in files:
        if len(files) > 1:
            print(f"==> {log.path} <==", flush=True)
        with open(log.path, "rb") as handle:
            shutil.copyfileobj(handle, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return 0


def run_resume(args: argparse.Namespace) -> int:
    from hpctrain.launch.resume import resume_run

    submission, checkpoint = resume_run(_find(args), args.overrides, dry_run=args.dry_run)
    print(f"{'would resume' if args.dry_run else 'resuming'} from {checkpoint}")
    _print_submission(submission, args.dry_run)
    if submission.scratch is not None:  # a dry run: the run is untouched; what it would change
        print(f"dry run: nothing in the run changed; new job files in {submission.scratch}")
        print("\n".join(f"would change {line}" for line in submission.changes) or "would change nothing in the job")
    if args.wait and not args.dry_run:
        from hpctrain.config import load_job

        _wait(submission, load_job(str(submission.run_dir / "job.yaml"), args.overrides), args.timeout)
    return 0
