"""The `hpctrain` command: parse arguments, call one stage function, print, map errors to exit codes.

Each stage's subcommands are registered by a `register(subparsers)` function in a small module of this
package (hpctrain/cli/<stage>.py) that imports only argparse at top level; the stage itself is imported
when its command runs, so `hpctrain validate` never pays for (or imports) torch. This package is the
only place stages meet; no stage imports it (docs/architecture.md, "Who imports whom").
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from hpctrain import __version__
from hpctrain.errors import HpctrainError

# Modules with a `register(subparsers)` function, in --help order. Only commands that work are listed.
COMMAND_MODULES = (
    "hpctrain.cli.config",
    "hpctrain.cli.plan",
    "hpctrain.cli.render",
    "hpctrain.cli.data",
    "hpctrain.cli.export",
    "hpctrain.cli.launch",
    "hpctrain.cli.diagnose",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Plan, render, launch and diagnose hybrid-parallel transformer training on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        if getattr(args, "wants_scheduler_query", False) and not getattr(args, "no_scheduler", False):
            # The composition root joins the stages: the doctor reads Slurm's view through launch's wrapper.
            from hpctrain.launch.slurm.commands import job_query

            args.scheduler_query = job_query()
        return int(args.handler(args) or 0)
    except HpctrainError as exc:
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(line, file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("hpctrain: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
