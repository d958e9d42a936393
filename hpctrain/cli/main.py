"""The `hpctrain` command: parse arguments, call one stage function, print, map errors to exit codes.

Each stage's subcommands are registered by a `register(subparsers)` function in a small module of this
package (hpctrain/cli/<stage>.py) that imports only argparse at top level; the stage itself is imported
when its command runs, so `hpctrain validate` never pays for (or imports) torch. This package is the
only place stages meet; no stage imports it (docs/architecture.md, "Who imports whom").
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Optional, Sequence

from hpctrain import __version__
from hpctrain.errors import HpctrainError
from hpctrain.process_exit import exit_now

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
# The module that registers each command: `hpctrain validate ...` builds only its own module's parsers, not
# all 19 (tests/test_cli_help.py checks this table against what the modules register).
COMMAND_MODULE = {
    "validate": "hpctrain.cli.config", "schema": "hpctrain.cli.config",
    "plan": "hpctrain.cli.plan", "topo": "hpctrain.cli.plan",
    "render": "hpctrain.cli.render",
    "data": "hpctrain.cli.data",
    "export": "hpctrain.cli.export",
    "submit": "hpctrain.cli.launch", "sweep": "hpctrain.cli.launch", "status": "hpctrain.cli.launch",
    "cancel": "hpctrain.cli.launch", "logs": "hpctrain.cli.launch", "resume": "hpctrain.cli.launch",
    "follow": "hpctrain.cli.launch", "clean": "hpctrain.cli.launch",
    "doctor": "hpctrain.cli.diagnose", "report": "hpctrain.cli.diagnose",
}


def _terminal_columns() -> int:
    """The width shutil.get_terminal_size() gives (Lib/shutil.py): COLUMNS when it is a positive integer, else
    the columns of sys.__stdout__'s terminal, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help formatter at the width it would take (the terminal's, less 2), measured without shutil:
    argparse makes a formatter at every add_argument (to check the metavar), and the constructor imports shutil
    for the width, which imports bz2 and lzma (~1 ms of `hpctrain validate`; issue 23 item 8)."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24,
                 width: Optional[int] = None) -> None:
        super().__init__(prog, indent_increment, max_help_position,
                         _terminal_columns() - 2 if width is None else width)


class _ArgumentParser(argparse.ArgumentParser):
    """ArgumentParser with _HelpFormatter by default; the subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(command: Optional[str] = None) -> argparse.ArgumentParser:
    """The `hpctrain` parser; with `command` (a name in COMMAND_MODULE), only that command's module is
    registered: the same parser for that command's arguments, help and errors, built in a fraction."""
    parser = _ArgumentParser(
        prog="hpctrain",
        description="Plan, render, launch and diagnose hybrid-parallel transformer training on Slurm.",
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (COMMAND_MODULE[command],) if command in COMMAND_MODULE else COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(words[0] if words else None)
    args = parser.parse_args(words)
    if not getattr(args, "handler", None):
        build_parser().print_help()  # every command, whichever was asked for
        return 2
    try:
        code = _run(args)
    finally:
        if argv is None:  # the process's own command line (the console script, python -m hpctrain): it exits next
            _before_exit()
    if argv is None and getattr(args, "exit_now", False):
        # A command that leaves nothing behind its output (validate): end without the interpreter's
        # teardown, which frees every object the schema left (~3 ms of ~140; hpctrain/process_exit.py).
        exit_now(code)
    return code


def _before_exit() -> None:
    """Spare the interpreter's exit its walk over every object alive now.

    At exit CPython collects garbage once more over all tracked objects; after `validate` those are the
    ~30k that building the job schema left (pydantic's core schemas, typing objects), and that walk and
    the freeing it leads to took ~13 ms of the command's ~140 (issue 23 item 8). gc.freeze() moves them to
    the permanent generation, which no collection visits, so the exit skips them. The cost: a finaliser on
    an object in a reference cycle no longer runs at exit (CPython never promises that it does); no command
    relies on one (files are closed by their with-blocks; hpctrain outside the runtime registers no
    __del__, atexit or weakref.finalize). Only where main() reads sys.argv: a caller that goes on running
    (a test calling main([...])) keeps its collector as it was."""
    import gc

    gc.freeze()


def _run(args: argparse.Namespace) -> int:
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
