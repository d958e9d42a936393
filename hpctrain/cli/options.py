"""Options shared by several commands."""

from __future__ import annotations

import argparse


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """The `--set KEY=VALUE` option shared by every command that reads a job."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a job.yaml value, e.g. --set parallel.tp=4 (repeatable; YAML scalars)")
