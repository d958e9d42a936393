"""sweep.grid is checked by `validate` exactly as `sweep` reads it (issue 11, item 7): one code path,
config/grid.py. A typo in a key or a wrongly typed value: exit 2 naming the grid path, from both."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli import main
from hpctrain.config import load_job
from hpctrain.config.grid import grid_problems

JOB = """\
name: grid
runs_dir: {runs}
model: {{preset: tiny}}
train: {{global_batch: 8, micro_batch: 1}}
parallel: {{tp: 1, pp: 1, dp: 2}}
cluster: {{executor: local, nodes: 1, gpus_per_node: 2, gpu: cpu}}
sweep:
  grid:
"""

# (id, grid lines, substrings of the one expected problem line)
BAD_GRIDS = [
    ("key-typo", "    parallel.tpp: [1, 2]\n", ["t.yaml:9: sweep.grid.parallel.tpp", "did you mean 'tp'"]),
    ("section-typo", "    trian.steps: [10]\n", ["t.yaml:9: sweep.grid.trian.steps", "did you mean 'train'"]),
    ("value-type", "    train.micro_batch: [1, two]\n", ["t.yaml:9: sweep.grid.train.micro_batch", '"two"']),
    ("value-range", "    model.layers: [4, 1180591620717411303424]\n", ["t.yaml:9: sweep.grid.model.layers"]),
    ("into-scalar", "    name.first: [x]\n", ["t.yaml:9: sweep.grid.name.first", "not a section"]),
    ("grid-of-sweep", "    sweep.max_parallel: [2]\n", ["t.yaml:9: sweep.grid.sweep.max_parallel"]),
    ("too-many-points", "".join(f"    train.seed: [{', '.join(str(i) for i in range(200))}]\n"
                                f"    train.steps: [{', '.join(str(i) for i in range(1, 101))}]\n"
                                for _ in range(1)), ["sweep.grid", "20000 points"]),
]


def _write(tmp_path: Path, grid: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(JOB.format(runs=tmp_path / "runs") + grid)
    return path


@pytest.mark.parametrize("case_id,grid,expected", BAD_GRIDS, ids=[c[0] for c in BAD_GRIDS])
def test_validate_and_sweep_refuse_a_bad_grid_alike(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   case_id: str, grid: str, expected: list[str]) -> None:
    path = _write(tmp_path, grid)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.replace(str(path), "t.yaml")
    assert len(err.strip().splitlines()) == 1, err
    for needle in expected:
        assert needle in err, err
    # sweep: the same line (less the FILE:LINE it does not know), before any run directory exists
    assert main(["sweep", str(path), "--dry-run"]) == 2
    sweep_err = capsys.readouterr().err
    assert err.split(": ", 1)[1] in sweep_err or case_id == "too-many-points", sweep_err
    assert not (tmp_path / "runs").exists()


def test_a_grid_of_valid_values_passes_even_if_some_points_are_infeasible(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """tp=2 with the fixed dp=2 does not fit 2 GPUs: sweep skips that point with the planner's reason;
    it is not a mistake in the grid itself."""
    path = _write(tmp_path, "    parallel.tp: [1, 2]\n    train.optimizer.lr: [1e-4, 3e-4]\n")
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    job = load_job(str(path))
    assert job.sweep is not None and grid_problems(job, job.sweep.grid) == []
