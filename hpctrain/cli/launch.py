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
WATCH_EVERY_S = 5.0  # status --watch without SECONDS


def _add_runs_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs-dir", default="runs", metavar="DIR", help="where to look for RUN by name (default: runs)")


def _add_wait(parser: argparse.ArgumentParser, wait: bool = True) -> None:
    """--wait (unless the command always follows), --timeout and --progress-every."""
    if wait:
        parser.add_argument("--wait", action="store_true",
                            help="follow the job until it ends, as `hpctrain follow` does (exit 0 completed, 1 "
                                 "failed or cancelled, 4 timed out, 130 Ctrl-C; the job goes on after 4 and 130)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="give up waiting after this long, exit 4 (default: the job's time limit x "
                             "(1 + max_requeues) + 10 min, or 24 h)")
    parser.add_argument("--progress-every", type=float, default=None, metavar="SECONDS",
                        help="when stderr is not a terminal (a log file, CI), print a line with step, loss, "
                             "tokens/s and ETA this often, and whenever the state changes (default: "
                             "$HPCTRAIN_PROGRESS_EVERY_S or 30); on a terminal a progress bar is drawn")


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
    _add_wait(sweep)
    sweep.set_defaults(handler=run_sweep)

    status = subparsers.add_parser(
        "status", help="state, restarts, step and tokens/s of a run or sweep; without RUN, a list of the runs",
        description="Where a run (or each task of a sweep) stands: the scheduler's state, restarts, the last "
                    "logged step, its tokens/s and loss, and the restart history. Without RUN, one line per run "
                    "in --runs-dir, newest first (dry runs hidden unless --all). --watch repeats it until every "
                    "run shown has ended.")
    status.add_argument("run", nargs="?", metavar="RUN",
                        help=_RUN_HELP + " (default: list every run, newest first)")
    status.add_argument("--json", action="store_true", help="print a JSON object (with --watch: one per line)")
    status.add_argument("--all", action="store_true", help="list dry runs too (hidden by default, with a count)")
    status.add_argument("--watch", nargs="?", const=str(WATCH_EVERY_S), default=None, metavar="SECONDS",
                        help=f"repeat every SECONDS (default {WATCH_EVERY_S:g}): on a terminal the screen is "
                             "redrawn, elsewhere each snapshot is printed; ends when every run shown has ended, "
                             "or on Ctrl-C (exit 0 both)")
    _add_runs_dir(status)
    status.set_defaults(handler=run_status_cmd)

    cancel = subparsers.add_parser(
        "cancel", help="cancel a run (all tasks of a sweep)",
        description="Ask the executor that started the run to stop it (scancel, the local supervisor, the Ray "
                    "job, the Volcano Job); a local run saves a checkpoint first. `resume` continues it.")
    cancel.add_argument("run", metavar="RUN", help=_RUN_HELP)
    cancel.add_argument("--task", type=int, default=None, metavar="T", help="cancel only array task T of a sweep")
    _add_runs_dir(cancel)
    cancel.set_defaults(handler=run_cancel)

    logs = subparsers.add_parser(
        "logs", help="print a run's per-rank logs (newest attempt)",
        description="Print the logs of a run's ranks (logs/rank-R.attempt-A.log; the batch output when the ranks "
                    "wrote none). -f follows them as they grow until the run ends, moving on to the next "
                    "attempt's logs when a restart begins one (unless --attempt fixes it).")
    logs.add_argument("run", metavar="RUN", help=_RUN_HELP + "; for a sweep task: RUN/tasks/T")
    logs.add_argument("--rank", type=int, default=None, metavar="R", help="only rank R (default: every rank)")
    logs.add_argument("--attempt", type=int, default=None, metavar="A", help="attempt A (default: the newest)")
    logs.add_argument("-f", "--follow", action="store_true",
                      help="keep printing what is appended until the run ends (Ctrl-C stops, exit 0)")
    _add_runs_dir(logs)
    logs.set_defaults(handler=run_logs)

    clean = subparsers.add_parser(
        "clean", help="remove the run directories of dry runs that never ran",
        description="List the run directories in --runs-dir that only `submit/sweep --dry-run` wrote (every event "
                    "a dry_run, no metrics, logs, rank summaries or checkpoints, never submitted); with --yes, "
                    "remove them. Nothing else is touched.")
    clean.add_argument("--dry-runs", action="store_true", required=True,
                       help="what to remove: dry runs (the only kind there is)")
    clean.add_argument("--yes", action="store_true", help="remove them (without it, only list them)")
    _add_runs_dir(clean)
    clean.set_defaults(handler=run_clean)

    follow = subparsers.add_parser(
        "follow", help="re-attach to a run: its progress until it ends, then its final state",
        description="Follow a submitted run (any executor; a sweep: every task) as `submit --wait` does: the "
                    "progress, then the final state. Exit 0 when it completed, 1 when it failed or was "
                    "cancelled, 4 when --timeout ran out, 130 on Ctrl-C (the run goes on after 4 and 130).")
    follow.add_argument("run", metavar="RUN", help=_RUN_HELP)
    _add_wait(follow, wait=False)
    _add_runs_dir(follow)
    follow.set_defaults(handler=run_follow)

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
    from hpctrain.launch.follow import default_timeout_s

    limit = slurm_time_seconds(job.slurm.time) if job.slurm.time is not None else None
    return default_timeout_s(limit, job.restart.max_requeues)


def run_submit(args: argparse.Namespace) -> int:
    from hpctrain.config import load_job
    from hpctrain.config.paths import absolute_paths
    from hpctrain.launch.submit import submit_job

    _check_wait_options(args)
    job = absolute_paths(load_job(args.job, args.overrides))
    submission = submit_job(job, dry_run=args.dry_run)
    _print_submission(submission, args.dry_run)
    if args.wait and not args.dry_run:
        _wait(submission, job, args)
    return 0


def _wait(submission: Any, job: Job, args: argparse.Namespace, waves: int = 1) -> None:
    """`--wait`: follow the job to its end (JobFailedError unless it completed). `waves`: how many times over
    a sweep's tasks run one after another (tasks / max_parallel), for the default timeout."""
    proc = submission.process  # a local supervisor, the child of this process: polled so that it is reaped
    try:
        timeout_s = args.timeout if args.timeout is not None else waves * _wait_timeout_s(job)
        _follow_to_end(submission.run_dir, timeout_s, args, on_poll=proc.poll if proc else None,
                       job_id=submission.job_id)
    except KeyboardInterrupt:  # Ctrl-C between the submission and the first poll: the job goes on all the same
        from hpctrain.launch.follow import FollowInterrupted

        raise FollowInterrupted(submission.run_dir, submission.job_id) from None


def _check_wait_options(args: argparse.Namespace) -> None:
    """--timeout and --progress-every, before anything is submitted."""
    import math

    from hpctrain.errors import ConfigError

    if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"--timeout: must be a positive number of seconds (got {args.timeout:g})")
    _progress_every_s(args)


def _progress_every_s(args: argparse.Namespace) -> float:
    import math
    import os

    from hpctrain.errors import ConfigError
    from hpctrain.launch.follow import PROGRESS_EVERY_S

    value, source = args.progress_every, "--progress-every"
    if value is None and os.environ.get("HPCTRAIN_PROGRESS_EVERY_S"):
        source = "HPCTRAIN_PROGRESS_EVERY_S"
        try:
            value = float(os.environ[source])
        except ValueError:
            raise ConfigError(f"{source}: expected a number of seconds (got {os.environ[source]!r}); e.g. 30") from None
    if value is None:
        return PROGRESS_EVERY_S
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{source}: must be a positive number of seconds (got {value:g}); e.g. 30")
    return value


def _follow_to_end(run_dir: Any, timeout_s: float, args: argparse.Namespace, **options: Any) -> None:
    """The one loop of --wait and `follow`: progress, then the final state (one line per task of a sweep),
    then exit 1 unless everything completed."""
    from hpctrain.launch.follow import check_completed, summary, wait_for_end

    status = wait_for_end(run_dir, timeout_s, progress_every_s=_progress_every_s(args), **options)
    for line in summary(status):
        print(line, flush=True)
    check_completed(run_dir, status)


def run_sweep(args: argparse.Namespace) -> int:
    import sys

    from hpctrain.config import load_job
    from hpctrain.config.paths import absolute_paths
    from hpctrain.launch.sweep import point_label, submit_sweep

    _check_wait_options(args)
    job = absolute_paths(load_job(args.job, args.overrides))
    submission, sweep = submit_sweep(job, args.grid, max_parallel=args.max_parallel, dry_run=args.dry_run)
    for skipped in sweep["skipped"]:
        reason = " ".join(line.strip() for line in skipped["reason"].splitlines())
        print(f"skipped {point_label(skipped['point'])}: {reason}", file=sys.stderr)
    print(f"{len(sweep['tasks'])} tasks, {len(sweep['skipped'])} skipped; array {sweep['array']}", file=sys.stderr)
    _print_submission(submission, args.dry_run)
    if args.wait and not args.dry_run:  # every task: exit 0 only when all completed
        from hpctrain.launch.follow import sweep_waves

        _wait(submission, job, args, waves=sweep_waves(sweep))
    return 0


def _find(args: argparse.Namespace) -> Any:
    from hpctrain.launch.rundir import find_run, newest_run

    return find_run(args.run, args.runs_dir) if args.run else newest_run(args.runs_dir)


def run_status_cmd(args: argparse.Namespace) -> int:
    import math

    from hpctrain.errors import ConfigError

    if args.watch is None:
        print(_status_text(args)[0])
        return 0
    try:
        args.watch = float(args.watch)
    except ValueError:  # `status --watch RUN`: argparse gave RUN to --watch
        if args.run is not None:
            raise ConfigError(f"--watch: expected a number of seconds (got {args.watch!r}); e.g. --watch 5") from None
        args.run, args.watch = args.watch, WATCH_EVERY_S
    if not (math.isfinite(args.watch) and args.watch > 0):
        raise ConfigError(f"--watch: must be a positive number of seconds (got {args.watch:g}); e.g. --watch 5")
    return _watch(args)


def _status_text(args: argparse.Namespace) -> tuple[str, bool]:
    """(what `status` prints now, whether every run it shows has ended)."""
    import json

    from hpctrain.launch.status import format_table, is_active, is_finished, json_safe, run_status

    indent = None if args.json and args.watch is not None else 2  # --json --watch: one JSON document per line
    if args.run is None:  # every run, newest first
        from hpctrain.launch.listing import format_runs, hidden_note, list_runs

        every = list_runs(args.runs_dir)
        rows = every if args.all else [row for row in every if row["state"] != "DRY_RUN"]
        ended = all(not is_active(row) and row["state"] != "UNKNOWN" for row in rows)
        if args.json:
            return json.dumps(json_safe(rows), indent=indent, default=str, allow_nan=False), ended
        note = hidden_note(len(every) - len(rows))
        if not rows and note:
            return f"no submitted runs in {args.runs_dir}/ {note}", ended
        return format_runs(rows, args.runs_dir) + (f"\n{note}" if note else ""), ended
    status = run_status(_find(args))
    return (json.dumps(json_safe(status), indent=indent, default=str, allow_nan=False) if args.json
            else format_table(status)), is_finished(status)


def _watch(args: argparse.Namespace) -> int:
    """`status --watch`: redraw on a terminal, else a snapshot per interval; exit 0 when all shown ended or
    on Ctrl-C."""
    import sys
    import time

    redraw = sys.stdout.isatty() and not args.json
    try:
        while True:
            text, ended = _status_text(args)
            if redraw:
                sys.stdout.write("\x1b[H\x1b[2J")  # cursor home, clear the screen
            elif not args.json:
                print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}")
            print(text, flush=True)
            if ended:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def run_cancel(args: argparse.Namespace) -> int:
    from hpctrain.launch.cancel import cancel_run
    from hpctrain.rundir.terminal import printable

    run_dir = _find(args)
    job_id, ended = cancel_run(run_dir, args.task)
    if ended:
        print(printable(f"job {job_id} had already ended ({ended}); nothing to cancel ({run_dir})"))
    else:
        print(printable(f"cancelled job {job_id} ({run_dir})"))
    return 0


def run_logs(args: argparse.Namespace) -> int:
    import shutil
    import sys

    from hpctrain.errors import ConfigError
    from hpctrain.launch.logs import pick_logs, remote_logs
    from hpctrain.rundir.terminal import printable

    run_dir = _find(args)
    remote = remote_logs(run_dir)  # logs the executor keeps elsewhere (a Volcano Job's pod output)
    if remote is not None:
        if args.follow:
            raise ConfigError(f"--follow: this run's executor keeps its logs elsewhere ({remote.note}); "
                              "follow them there, or drop -f for what is there now")
        print(f"hpctrain logs: {remote.note}", file=sys.stderr)
        sys.stdout.write(remote.text)
        return 0
    if args.follow:
        return _follow_logs(run_dir, args)
    files, note = pick_logs(run_dir, args.rank, args.attempt)
    if note:
        print(printable(f"hpctrain logs: {note}"), file=sys.stderr)
    for log in files:
        if len(files) > 1:
            print(printable(f"==> {log.path} <=="), flush=True)  # the log's own bytes are copied as they are
        with open(log.path, "rb") as handle:
            shutil.copyfileobj(handle, sys.stdout.buffer)
        sys.stdout.buffer.flush()
    return 0


def _follow_logs(run_dir: Any, args: argparse.Namespace) -> int:
    """`logs -f`: until the run ends (every task of a sweep task's run directory: its own state), or Ctrl-C."""
    import sys

    from hpctrain.launch.logs import follow_logs
    from hpctrain.launch.status import is_finished, run_status

    def note(text: str) -> None:
        print(f"hpctrain logs: {text}", file=sys.stderr, flush=True)

    try:
        follow_logs(run_dir, args.rank, args.attempt, sys.stdout.buffer, note=note,
                    ended=lambda: is_finished(run_status(run_dir, details=False)))
    except KeyboardInterrupt:
        pass
    return 0


def run_clean(args: argparse.Namespace) -> int:
    from hpctrain.launch.clean import dry_runs, remove

    found = dry_runs(args.runs_dir)
    if not found:
        print(f"no dry runs in {args.runs_dir}/")
        return 0
    if not args.yes:
        for path in found:
            print(f"would remove {path}")
        print(f"{len(found)} dry run(s); rerun with --yes to remove them")
        return 0
    for path in found:
        remove([path])
        print(f"removed {path}")
    return 0


def run_follow(args: argparse.Namespace) -> int:
    from hpctrain.errors import ConfigError
    from hpctrain.launch.follow import run_timeout_s
    from hpctrain.launch.rundir import last_submission

    _check_wait_options(args)
    run_dir = _find(args)
    sub = last_submission(run_dir)
    if not sub or not sub.get("job_id"):
        raise ConfigError(f"RUN: {run_dir} was never submitted (a dry run, or refused); nothing to follow; "
                          "submit it with `hpctrain submit`")
    timeout_s = args.timeout if args.timeout is not None else run_timeout_s(run_dir)
    _follow_to_end(run_dir, timeout_s, args, job_id=str(sub["job_id"]))
    return 0


def run_resume(args: argparse.Namespace) -> int:
    from hpctrain.launch.resume import resume_run

    _check_wait_options(args)
    submission, checkpoint = resume_run(_find(args), args.overrides, dry_run=args.dry_run)
    print(f"{'would resume' if args.dry_run else 'resuming'} from {checkpoint}")
    _print_submission(submission, args.dry_run)
    if submission.scratch is not None:  # a dry run: the run is untouched; what it would change
        print(f"dry run: nothing in the run changed; new job files in {submission.scratch}")
        print("\n".join(f"would change {line}" for line in submission.changes) or "would change nothing in the job")
    if args.wait and not args.dry_run:
        from hpctrain.config import load_job

        _wait(submission, load_job(str(submission.run_dir / "job.yaml"), args.overrides), args)
    return 0
