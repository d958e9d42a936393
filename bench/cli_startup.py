"""Median wall time of login-path commands beside `python -c pass`; asserts torch is never imported.

    python bench/cli_startup.py [--runs 15]

Goals: `validate` under 0.4 s median and under 6x `python -c pass` (issue 2); `render` under 0.4 s
median (issue 5). Neither may import torch. The machine is shared: run it when it is quiet.
"""

from __future__ import annotations

import argparse
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
    if (REPO / "hpctrain" / "render" / "commands.py").exists():
        cmds["render"] = ["render", QUICKSTART, "-o", out_dir]
    return cmds


def median_time(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_free(args: list[str]) -> bool:
    code = ("import sys; from hpctrain.cli import main; main(%r); "
            "sys.exit(1 if 'torch' in sys.modules else 0)" % (args,))
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    opts = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory() as out_dir:
        # Interleave the baseline with each command so both see the same machine load.
        baseline = median_time([sys.executable, "-c", "pass"], opts.runs)
        print(f"python -c pass          median {baseline * 1000:7.1f} ms over {opts.runs} runs")
        for name, args in commands(out_dir).items():
            took = median_time([*HPCTRAIN.split(), *args], opts.runs)
            base2 = median_time([sys.executable, "-c", "pass"], opts.runs)
            ratio = took / ((baseline + base2) / 2)
            clean = torch_free(args)
            ratio_goal = 6 if name == "validate" else float("inf")
            verdict = "ok" if took < 0.4 and ratio < ratio_goal and clean else "MISSED"
            ok = ok and verdict == "ok"
            print(f"hpctrain {name:<14} median {took * 1000:7.1f} ms  = {ratio:4.1f}x python -c pass  "
                  f"torch imported: {'no' if clean else 'YES'}  [{verdict}: goal < 400 ms"
                  f"{' and < 6x' if ratio_goal < 100 else ''}]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
