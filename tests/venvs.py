"""Fresh virtual environments for the packaging tests: made from the base interpreter with no system site
packages, so nothing installed by hand on this machine (or in the test venv) can stand in for a missing
install step. Each gets its own build environment: a setuptools new enough to build wheels by itself
(bdist_wheel is built into setuptools >= 70.1; the interpreter's bundled 65.x needs the `wheel` package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILD_REQUIREMENT = "setuptools>=70.1"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel on this machine's disk; an unpinned torch pulls a CUDA build


def clean_env() -> dict[str, str]:
    """The environment without this test run's venv, PYTHONPATH or a checkout on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    bin_dir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir)
    return env


def base_python() -> str:
    """The interpreter this test venv was made from (sys._base_executable), not the venv's own."""
    return getattr(sys, "_base_executable", None) or sys.executable


def run(argv: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout_s: float = 600,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                            timeout=timeout_s, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {result.returncode}\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-3000:]}")
    return result


def fresh_venv(path: Path) -> Path:
    """A new venv at `path` (pip, no system site packages) with its own build environment; returns its python."""
    run([base_python(), "-m", "venv", str(path)], cwd=path.parent, timeout_s=120)
    python = path / "bin" / "python"
    pip_install(python, BUILD_REQUIREMENT)
    return python


def pip_install(python: Path, *requirements: str, options: tuple[str, ...] = ()) -> None:
    constraints = python.parent.parent / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(constraints),
         *options, *requirements], cwd=python.parent, timeout_s=900)


def clean_checkout(dest: Path) -> Path:
    """The files of the checkout as a fresh clone has them (tracked, plus new files git does not ignore)."""
    names = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                env=dict(os.environ)).stdout.split("\0")
    for name in filter(None, names):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def build_wheel(python: Path, source: Path, out: Path) -> Path:
    """Build hpctrain's wheel from `source` with `python`'s own build environment (no isolation, no index)."""
    run([str(python), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(out), str(source)], cwd=out.parent, timeout_s=300)
    [wheel] = out.glob("hpctrain-*.whl")
    return wheel
