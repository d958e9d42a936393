"""The command line: the only package where the stages meet (docs/architecture.md). Nothing imports it."""

from hpctrain.cli.main import COMMAND_MODULES, build_parser, main
from hpctrain.cli.options import add_set_option

__all__ = ["COMMAND_MODULES", "add_set_option", "build_parser", "main"]
