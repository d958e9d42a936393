"""`plan`'s tables (plan/report.py `simple_table`): tabulate's "simple" format without number parsing, character for
character, without importing tabulate on `plan`'s path. Torch-free."""

from __future__ import annotations

import random
import string
import subprocess
import sys

from tabulate import tabulate

from hpctrain.plan.report import simple_table


def _cell(rng: random.Random) -> object:
    kind = rng.random()
    if kind < 0.3:
        return rng.randint(0, 100000)
    if kind < 0.5:
        return f"{rng.random() * 1000:.{rng.randint(0, 3)}f}"
    return "".join(rng.choice(string.ascii_letters + " -=.,%") for _ in range(rng.randint(0, 14)))


def test_simple_table_is_tabulates_simple_format_on_random_tables() -> None:
    rng = random.Random(3)
    for _ in range(3000):
        columns = rng.randint(1, 8)
        headers = ["".join(rng.choice(string.ascii_letters + " /#") for _ in range(rng.randint(1, 12)))
                   for _ in range(columns)]
        rows = [[_cell(rng) for _ in range(columns)] for _ in range(rng.randint(0, 6))]
        expected = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
        assert simple_table(rows, headers) == expected, (headers, rows)


def test_plan_prints_its_tables_without_importing_tabulate(tmp_path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: t\nmodel: {preset: llama3-8b}\ntrain: {global_batch: 64}\n"
                   "cluster: {nodes: 2, gpus_per_node: 8, gpu: h100-80gb}\n")
    probe = ("import sys; from hpctrain.cli import main\n"
             "try:\n    main(['plan', sys.argv[1]])\nexcept SystemExit:\n    pass\n"
             "print('tabulate loaded' if 'tabulate' in sys.modules else 'tabulate not loaded')")
    done = subprocess.run([sys.executable, "-c", probe, str(job)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "mem GiB" in done.stdout and "memory of pp rank" in done.stdout
    assert done.stdout.rstrip().endswith("tabulate not loaded"), done.stdout[-500:]
