"""`hpctrain render`: files written and printed, --stdout, errors as exit 2, no torch on the login path."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpctrain.errors import HpctrainError

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")


def _main(argv: list[str]) -> int:
    """The command as hpctrain.cli runs it (parse, call the handler, map errors to exit codes)."""
    from hpctrain.cli import render as commands

    parser = argparse.ArgumentParser(prog="hpctrain")
    commands.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except HpctrainError as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code


def test_render_writes_script_recipe_and_resolved_job(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert _main(["render", QUICKSTART, "-o", str(out), "--set", "slurm.partition=debug"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / "job.sbatch"), str(out / "recipe.def"), str(out / "job.resolved.yaml")]
    script = (out / "job.sbatch").read_text()
    assert "#SBATCH --partition=debug\n" in script and f"RUN_DIR={out}\n" in script
    assert (out / "job.sbatch").stat().st_mode & 0o111
    resolved = yaml.safe_load((out / "job.resolved.yaml").read_text())
    assert resolved["placement"] is not None and resolved["parallel"]["dp"] == 2
    assert (out / "recipe.def").read_text().startswith("Bootstrap: docker\n")


def test_render_stdout_prints_the_script_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["render", QUICKSTART, "--stdout", "--run-dir", "/scratch/r1", "-o", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash\n") and "RUN_DIR=/scratch/r1\n" in out
    assert not (tmp_path / "o").exists()


def test_render_mistakes_exit_2_with_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    assert _main(["render", QUICKSTART, "--stdout", "--set", "slurm.partition=a b"]) == 2
    assert "slurm.partition: not a valid --partition value" in capsys.readouterr().err


def test_commands_module_is_light_and_render_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import hpctrain.cli.render\n"
        "heavy = [m for m in ('jinja2', 'torch', 'pydantic', 'yaml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from tests.render.test_cli import _main\n"
        f"assert _main(['render', {QUICKSTART!r}, '-o', {str(tmp_path)!r}]) == 0\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
