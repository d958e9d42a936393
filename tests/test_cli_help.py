"""Every command's --help: each positional argument says what it is, and no escaped `%%` leaks out."""

from __future__ import annotations

import argparse

import pytest

from hpctrain.cli import build_parser


def _subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"{prefix}{name}", sub))
                found.extend(_subcommands(sub, f"{prefix}{name} "))
    return found


COMMANDS = _subcommands(build_parser())


def test_every_stage_registers_commands() -> None:
    names = {name for name, _ in COMMANDS}
    assert {"validate", "plan", "render", "submit", "sweep", "status", "logs", "doctor", "data prepare"} <= names


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_help(name: str, parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if not action.option_strings and not isinstance(action, argparse._SubParsersAction):
            assert action.help, f"hpctrain {name}: positional {action.metavar or action.dest} has no help text"
    text = parser.format_help()
    assert "%%" not in text, f"hpctrain {name} --help shows an escaped %%"


def test_each_command_is_found_in_its_module_with_the_same_help() -> None:
    """main() builds only the module of the command asked for (cli/main.py COMMAND_MODULE): the table names
    every command of every module, and the parser built that way gives the same help and usage."""
    import importlib

    from hpctrain.cli.main import COMMAND_MODULE, COMMAND_MODULES

    registered = {}
    for module in COMMAND_MODULES:
        parser = argparse.ArgumentParser(prog="hpctrain")
        importlib.import_module(module).register(parser.add_subparsers())
        registered.update({name: module for name, _ in _subcommands(parser) if " " not in name})
    assert COMMAND_MODULE == registered
    full = dict(COMMANDS)
    for command in COMMAND_MODULE:
        for name, sub in _subcommands(build_parser(command)):
            assert sub.format_help() == full[name].format_help() and sub.format_usage() == full[name].format_usage()


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[name for name, _ in COMMANDS])
def test_every_command_has_a_description(name: str, parser: argparse.ArgumentParser) -> None:
    """`hpctrain CMD --help` says what CMD does, beyond its usage line (issue 29: status, logs, cancel had none)."""
    assert parser.description and len(parser.description.split()) >= 5, f"hpctrain {name} --help has no description"
