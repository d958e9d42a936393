"""CLI commands of the diagnose stage: `doctor` and `report`. Only argparse is imported at top level."""

from __future__ import annotations

import argparse


def register(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    doctor = subparsers.add_parser(
        "doctor", help="find what is wrong with a run, with evidence and fixes",
        description="Read a run directory (finished, failed or still running) and print findings: out of memory, "
                    "communication share, imbalance, pipeline bubble, MFU, hangs, requeue problems; each with "
                    "evidence and `--set` fixes the planner has re-checked. Exit 0 when nothing is found, 1 when "
                    "something is.")
    doctor.add_argument("run", metavar="RUN", help="a run directory, a run name in runs/, or a sweep directory")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    doctor.add_argument("--runs-dir", default="runs", help="where to look for RUN by name (default: runs)")
    doctor.add_argument("--stall-minutes", type=float, default=10.0, metavar="N",
                        help="report no progress after N minutes without a metrics line (default 10)")
    doctor.add_argument("--no-scheduler", action="store_true", help="do not ask Slurm (sacct/scontrol) about the job")
    # scheduler_query: Slurm's view of the job (sacct), given by hpctrain/cli/main.py from the launch stage's wrapper
    # when --no-scheduler is not set; diagnose itself never imports launch (docs/architecture.md section 6).
    doctor.set_defaults(handler=run_doctor, scheduler_query=None, wants_scheduler_query=True)

    report = subparsers.add_parser(
        "report", help="tables and PNG plots of a run or a sweep",
        description="Loss and tokens/s over steps with restarts marked, memory planned vs measured per component; "
                    "for a sweep, tokens/s and MFU per configuration, ranked, beside the planner's estimate. "
                    "PNGs need the plot extra (pip install 'hpctrain[plot]'); without it, report.txt alone (exit 0).")
    report.add_argument("run", metavar="RUN|SWEEP", help="a run directory, a run name in runs/, or a sweep directory")
    report.add_argument("-o", "--output", metavar="DIR", help="where to write report.txt and the PNGs "
                                                              "(default: RUN/report)")
    report.add_argument("--runs-dir", default="runs", help="where to look for RUN by name (default: runs)")
    report.add_argument("--no-plots", action="store_true", help="tables only")
    report.set_defaults(handler=run_report)


def run_doctor(args: argparse.Namespace) -> int:
    import json

    from hpctrain.diagnose.context import Thresholds
    from hpctrain.diagnose.doctor import diagnose_run, format_diagnosis
    from hpctrain.errors import ConfigError
    from hpctrain.rundir.layout import find_run, is_sweep, task_dirs

    if args.stall_minutes <= 0:
        raise ConfigError(f"--stall-minutes: must be > 0 (got {args.stall_minutes}); e.g. --stall-minutes 10")
    root = find_run(args.run, args.runs_dir)
    runs = task_dirs(root) if is_sweep(root) else [root]
    query = None if args.no_scheduler else args.scheduler_query
    thresholds = Thresholds(stall_minutes=args.stall_minutes)
    results = [diagnose_run(path, thresholds=thresholds, scheduler_query=query) for path in runs]
    if args.json:
        data = [d.to_json() for d in results]
        print(json.dumps(data if is_sweep(root) else data[0], indent=2))
    else:
        print("\n\n".join(format_diagnosis(d) for d in results))
    return 1 if any(d.findings for d in results) else 0


def run_report(args: argparse.Namespace) -> int:
    import sys

    from hpctrain.diagnose.plots import NO_MATPLOTLIB, have_matplotlib
    from hpctrain.diagnose.report import write_report
    from hpctrain.rundir.layout import find_run

    root = find_run(args.run, args.runs_dir)
    plots = not args.no_plots and have_matplotlib()
    text, files = write_report(root, args.output, plots=plots)
    print(text)
    print("\nwrote: " + ", ".join(str(f) for f in files))
    if plots != (not args.no_plots):  # the tables are the report; the pictures are an extra
        print(NO_MATPLOTLIB, file=sys.stderr)
    return 0
