"""Median wall time of login-path commands beside `python -c pass`; asserts torch is never imported.

    python bench/cli_startup.py [--runs 15]

Goals: `validate` under 0.4 s median and under 6x `python -c pass` (issues 2 and 23); `render` under 0.4 s
median (issue 5). Neither may import torch. Each command and `python -c pass` run in turn (A B A B ...)
and the ratio is of the medians, of wall time and of CPU time (user + system: the steadier one on a
loaded machine). hpctrain's modules are byte-compiled first, as `pip install` leaves them: under
PYTHONDONTWRITEBYTECODE an editable checkout would otherwise compile ~40 modules in every run.
The machine is shared: run it when it is quiet.
"""

from __future__ import annotations

import argparse
import compileall
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
# The installed console script, as a user runs it (falls back to the module in a bare checkout).
HPCTRAIN = shutil.which("hpctrain") or f"{sys.executable} -m hpctrain"


def commands(out_dir: str) -> dict[str, list[str]]:
    """The login-path commands to time; later stages add theirs when they exist."""
    cmds = {"validate": ["validate", QUICKSTART]}
    if (REPO / "hpctrain" / "cli" / "render.py").exists():
        cmds["render"] = ["render", QUICKSTART, "-o", out_dir]
    return cmds


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def interleaved(argv: list[str], baseline: list[str], runs: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Medians (wall, cpu) of argv and of baseline, run in turn."""
    mine, base = [], []
    timed(argv)  # warm-up: the page cache
    for _ in range(runs):
        mine.append(timed(argv))
        base.append(timed(baseline))
    return ((statistics.median(t[0] for t in mine), statistics.median(t[1] for t in mine)),
            (statistics.median(t[0] for t in base), statistics.median(t[1] for t in base)))


def torch_free(args: list[str]) -> bool:
    code = ("import sys; from hpctrain.cli import main; main(%r); "
            "sys.exit(1 if 'torch' in sys.modules else 0)" % (args,))
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    ok = True
    compileall.compile_dir(str(REPO / "hpctrain"), quiet=1)
    baseline = [sys.executable, "-c", "pass"]
    with tempfile.TemporaryDirectory() as out_dir:
        for name, args in commands(out_dir).items():
            (took, took_cpu), (base, base_cpu) = interleaved([*HPCTRAIN.split(), *args], baseline, opts.runs)
            ratio, cpu_ratio = took / base, took_cpu / base_cpu
            clean = torch_free(args)
            ratio_goal = 6 if name == "validate" else float("inf")
            verdict = "ok" if took < 0.4 and ratio < ratio_goal and clean else "MISSED"
            ok = ok and verdict == "ok"
            print(f"hpctrain {name:<14} median {took * 1000:7.1f} ms  = {ratio:4.1f}x python -c pass "
                  f"({base * 1000:.1f} ms; cpu {cpu_ratio:4.1f}x)  torch imported: {'no' if clean else 'YES'}  "
                  f"[{verdict}: goal < 400 ms{' and < 6x' if ratio_goal < 100 else ''}]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
