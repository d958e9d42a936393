"""README's "A 60-second tour": every file it names ships, every command it shows parses, and the ones that
need no cluster and no run (validate, topo) run with the exit code the tour shows (issue 29: the tour named
job.yaml, nvidia-smi-topo.txt and topology.conf, none of which shipped)."""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path

import pytest

from hpctrain.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]


def _tour_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## A 60-second tour", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        for line in block.splitlines():
            line = line.removeprefix("$ ")
            if line.startswith("hpctrain "):
                commands.append(re.split(r"\s{2,}#", line, maxsplit=1)[0].strip())
    return commands


COMMANDS = _tour_commands()


def _words(command: str) -> list[str]:
    """The command as a user types it: [optional] parts kept, RUN a run's name, N a step, globs expanded."""
    words = []
    for word in shlex.split(command.replace("[", "").replace("]", ""))[1:]:
        word = {"RUN": "quickstart", "N": "10"}.get(word, word)
        words.extend(sorted(glob.glob(str(REPO / word))) if "*" in word else [word])
    return words


def test_the_tour_shows_commands() -> None:
    assert len(COMMANDS) >= 15 and any(c.startswith("hpctrain topo ") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_file_the_tour_names_ships_and_its_command_parses(command: str) -> None:
    words = _words(command)
    for word in words:
        if re.search(r"\.(ya?ml|txt|conf)$", word):
            assert (REPO / word).is_file(), f"the tour names {word}, which does not ship: {command}"
    build_parser(words[0]).parse_args(words)  # exits 2 (SystemExit) on an option the command does not have


@pytest.mark.parametrize("command,code", [(c, 2 if "micro_bach" in c else 0) for c in COMMANDS
                                          if c.split()[1] in ("validate", "topo")])
def test_the_tours_checks_run(command: str, code: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    assert main(_words(command)) == code
