"""`plan`'s tables (plan/report.py `simple_table`): tabulate's "simple" format without number parsing, character for
character (that `plan` does not import tabulate: tests/plan/test_planner.py). Torch-free."""

from __future__ import annotations

import random
import string

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

