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
